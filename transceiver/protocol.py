"""The transceiver's wire messages: versioned, msgpack-serialisable, never pickle.

    prefill (sender, rank 0)                          decode (receiver, rank 0)
                                              <---    Challenge(nonce)        (auth.py)
    Hello(layout, backend info, proof) ---->          proof checked before anything else
                                              <---    Hello(layout, backend info, proof, the
                                                            shard addresses of every decode rank)
    TransferRequest(request, state_pos, ...)  --->    validate, allocate; arm the other ranks
                                              <---    ReceivePlan(held blocks, dst blocks, slot)
    KV blocks [held, n) + live state slot     --->    (data plane: TCP bytes or NIXL writes)
      (rank 0's shards; every other rank pair      (each decode rank lands what it expects)
       on its own shard link: ShardStart + data)
    TransferDone                              --->    admit, continue decoding
                                              <---    TransferAck        (prefill frees)
    TransferAbort / TransferError either way at any point: both sides release.

Every message is a dict {"v": PROTOCOL_VERSION, "type": ..., fields}; decoding checks both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import msgpack

from hybridserve.transceiver.layout import PeerLayout

# 2: layouts carry the model's KV head and Mamba2 group totals (replicated shards).
# 3: Hello carries the decode ranks' shard addresses; ShardStart opens a rank pair's data.
# 4: SamplingState carries the n > 1 choices' seeds and first tokens, and first-token logprobs.
# 5: links open with a Challenge; Hello carries a nonce and a proof of the deployment's secret.
# 6: layouts describe recurrent state as a kind and its named tensors (any recurrent kind).
# 8: layouts carry the KV pool's planes (K and V, or a latent attention cache's one).
PROTOCOL_VERSION = 8
# The largest message accepted from an authenticated peer (a TransferRequest carries the
# prompt): 64 MiB.
MAX_MESSAGE_BYTES = 64 << 20
# The largest at any other point: the handshake (from a peer not yet authenticated, so the
# memory an unknown peer can make a listener allocate stays small) and the messages around a
# transfer's data (a plan, a frame header, done, ack, abort). A Hello carries NIXL's agent
# metadata, a few KiB.
CONTROL_MAX_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A peer sent something this side cannot accept; the message says what."""


@dataclass(frozen=True)
class Challenge:
    """The first message on every accepted link: what the connecting peer must sign."""

    nonce: bytes
    type: ClassVar[str] = "challenge"


@dataclass(frozen=True)
class Hello:
    layout: PeerLayout
    backend: str
    # Backend-specific connection data (NIXL agent metadata and pool descriptors).
    backend_info: bytes = b""
    # A decode engine: where each of its ranks accepts shard links (rank order); empty from a
    # prefill engine, and on a shard link itself.
    shard_addresses: list[list[Any]] = field(default_factory=list)
    # The sender's nonce and its proof that it holds the deployment's secret (auth.py).
    nonce: bytes = b""
    proof: bytes = b""
    type: ClassVar[str] = "hello"


@dataclass(frozen=True)
class ShardStart:
    """On a shard link (prefill rank i -> decode rank j): the data of `request_id` follows,
    the pieces of rank i's shards that rank j holds."""

    request_id: str
    src_rank: int
    type: ClassVar[str] = "shard_start"


@dataclass(frozen=True)
class SamplingState:
    """What the receiver needs to continue sampling exactly as the sender would."""

    params: dict[str, Any]
    sample_seed: int
    stop_token_ids: list[int]
    # n > 1: the other choices' seeds and the first tokens the sender drew for them (the
    # receiver forks them); logprobs of the first token(s) when asked for, each as
    # [token id, logprob, [[id, logprob], ...]], the request's own first.
    choice_seeds: list[int] = field(default_factory=list)
    fork_token_ids: list[int] = field(default_factory=list)
    first_logprobs: list[list[Any]] = field(default_factory=list)
    # Speculative decoding with MTP layers: the sender's guesses of the tokens after the
    # first, which the receiver verifies in its first step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TransferRequest:
    request_id: str
    prompt_token_ids: list[int]
    # Keys of the prompt's full blocks (salted chain): the receiver skips those it holds.
    block_hashes: list[bytes]
    cache_salt: str | None
    # Tokens the shipped recurrent state has consumed: the whole prompt.
    state_pos: int
    first_token: int
    sampling: SamplingState
    num_cached_tokens: int
    compatibility_hash: str
    type: ClassVar[str] = "transfer_request"


@dataclass(frozen=True)
class ReceivePlan:
    request_id: str
    # The receiver already holds the first `held_blocks` blocks; send blocks [held, n).
    held_blocks: int
    dst_block_ids: list[int]
    dst_slot: int
    type: ClassVar[str] = "receive_plan"


@dataclass(frozen=True)
class DataFrame:
    """Announces `nbytes` raw bytes that follow: one region (a KV block, or one state tensor of a
    slot) for the receiver's `dst` block / slot (TCP backend)."""

    request_id: str
    kind: str  # "kv" or a state tensor's name ("conv", "ssm", "recurrent", ...)
    dst: int
    nbytes: int
    type: ClassVar[str] = "data_frame"


@dataclass(frozen=True)
class TransferDone:
    request_id: str
    type: ClassVar[str] = "transfer_done"


@dataclass(frozen=True)
class TransferAck:
    request_id: str
    type: ClassVar[str] = "transfer_ack"


@dataclass(frozen=True)
class TransferAbort:
    request_id: str
    reason: str
    type: ClassVar[str] = "transfer_abort"


@dataclass(frozen=True)
class TransferError:
    request_id: str
    code: str
    message: str
    type: ClassVar[str] = "transfer_error"


Message = (
    Challenge
    | Hello
    | ShardStart
    | TransferRequest
    | ReceivePlan
    | DataFrame
    | TransferDone
    | TransferAck
    | TransferAbort
    | TransferError
)
_TYPES: dict[str, type[Any]] = {
    cls.type: cls
    for cls in (
        Challenge,
        Hello,
        ShardStart,
        TransferRequest,
        ReceivePlan,
        DataFrame,
        TransferDone,
        TransferAck,
        TransferAbort,
        TransferError,
    )
}


def to_dict(message: Message) -> dict[str, Any]:
    data = asdict(message)
    return {"v": PROTOCOL_VERSION, "type": message.type, **data}


def from_dict(data: Any) -> Message:
    if not isinstance(data, dict):
        raise ProtocolError(f"expected a message object, got {type(data).__name__}")
    if data.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {data.get('v')!r} is not {PROTOCOL_VERSION}: "
            "both engines must run the same hybridserve transfer protocol"
        )
    cls = _TYPES.get(data.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown message type {data.get('type')!r}")
    values = {k: v for k, v in data.items() if k not in ("v", "type")}
    expected = {f.name for f in fields(cls)}
    if set(values) != expected:
        raise ProtocolError(f"{cls.type}: expected fields {sorted(expected)}, got {sorted(values)}")
    try:
        # NOTE: nested objects are checked here too: a malformed one is the peer's error, so it
        # must surface as a ProtocolError, never as a KeyError / TypeError from our own code.
        if cls is Hello:
            values["layout"] = PeerLayout.from_dict(values["layout"])
        if cls is TransferRequest:
            values["sampling"] = SamplingState(**values["sampling"])
        return cls(**values)
    except (TypeError, KeyError, ValueError) as exc:
        raise ProtocolError(f"{cls.type}: malformed ({type(exc).__name__}: {exc})") from exc


def encode(message: Message) -> bytes:
    return msgpack.packb(to_dict(message), use_bin_type=True)


def decode(payload: bytes) -> Message:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ProtocolError(f"not a msgpack message: {exc}") from exc
    return from_dict(data)


__all__ = [
    "CONTROL_MAX_BYTES",
    "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION",
    "Challenge",
    "DataFrame",
    "Hello",
    "Message",
    "ProtocolError",
    "ReceivePlan",
    "SamplingState",
    "ShardStart",
    "TransferAbort",
    "TransferAck",
    "TransferDone",
    "TransferError",
    "TransferRequest",
    "decode",
    "encode",
    "from_dict",
    "to_dict",
]
