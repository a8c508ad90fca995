"""The transceiver's wire messages: every message round-trips through msgpack exactly, the
wire form is pinned, and anything else a peer could send (another version, an unknown type, a
malformed or oversized payload, a pickle) is refused with a ProtocolError naming the problem.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
from pathlib import Path

import msgpack
import pytest

from hybridserve.transceiver import protocol
from hybridserve.transceiver.layout import PeerLayout, StateTensorLayout
from hybridserve.transceiver.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Challenge,
    DataFrame,
    Hello,
    ProtocolError,
    ReceivePlan,
    SamplingState,
    ShardStart,
    TransferAbort,
    TransferAck,
    TransferDone,
    TransferError,
    TransferRequest,
    decode,
    encode,
    from_dict,
    to_dict,
)

TRANSCEIVER = Path(protocol.__file__).parent

LAYOUT = PeerLayout(
    model_id="0123456789abcdef",
    tp_size=2,
    tp_rank=1,
    layer_kinds=("gdn", "attention", "mlp", "gdn"),
    kv_heads_per_layer=(0, 1, 0, 0),
    num_kv_heads=2,
    block_size=16,
    head_dim=32,
    kv_dtype="torch.bfloat16",
    state_kind="gdn",
    num_state_layers=2,
    state_tensors=(
        StateTensorLayout("conv", "torch.bfloat16", ((48, 2), (48, 2), (80, 8)), (3,)),
        StateTensorLayout("recurrent", "torch.float32", ((8, 8),), (24, 10)),
    ),
)

MESSAGES = [
    Hello(LAYOUT, "nixl", b"\x00agent\xffmetadata"),
    Hello(LAYOUT, "tcp"),
    Hello(LAYOUT, "tcp", shard_addresses=[["10.0.0.7", 41000], ["10.0.0.8", 41001]]),
    ShardStart("req-7", 1),
    TransferRequest(
        request_id="req-7",
        prompt_token_ids=[5, 0, 127, 3],
        block_hashes=[b"\x01" * 32, b"\x00\xff" * 16],
        cache_salt="tenant-a",
        state_pos=4,
        first_token=99,
        sampling=SamplingState(
            params={"temperature": 0.75, "top_p": 0.9, "max_tokens": 12, "stop": ["\n"]},
            sample_seed=2**63 - 1,
            stop_token_ids=[0, 2],
            draft_token_ids=[7, 7, 1],
        ),
        num_cached_tokens=16,
        compatibility_hash="f" * 32,
    ),
    TransferRequest(
        request_id="no-salt",
        prompt_token_ids=[1],
        block_hashes=[],
        cache_salt=None,
        state_pos=1,
        first_token=0,
        sampling=SamplingState(params={}, sample_seed=0, stop_token_ids=[]),
        num_cached_tokens=0,
        compatibility_hash="",
    ),
    ReceivePlan("req-7", held_blocks=2, dst_block_ids=[40, 3, 17], dst_slot=5),
    DataFrame("req-7", "ssm", dst=5, nbytes=1 << 33),
    TransferDone("req-7"),
    TransferAck("req-7"),
    TransferAbort("req-7", "client went away"),
    Challenge(bytes(range(16))),
    Hello(LAYOUT, "tcp", nonce=b"\x01" * 16, proof=b"\xfe" * 32),
    TransferError("req-7", "duplicate_request", "request id 'req-7' is already in use here"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_exactly(message):
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message
    # Field by field too: equal dataclasses could still hide a list that came back a tuple.
    for field in dataclasses.fields(message):
        assert getattr(decoded, field.name) == getattr(message, field.name)
        assert type(getattr(decoded, field.name)) is type(getattr(message, field.name))


def test_every_message_type_is_covered_here():
    """A new message type must get a round-trip case above."""
    assert {type(m) for m in MESSAGES} == set(protocol.Message.__args__)  # type: ignore[attr-defined]
    assert {type(m).type for m in MESSAGES} == {
        "challenge",
        "hello",
        "shard_start",
        "transfer_request",
        "receive_plan",
        "data_frame",
        "transfer_done",
        "transfer_ack",
        "transfer_abort",
        "transfer_error",
    }


def test_the_wire_form_is_pinned():
    """A msgpack map {"v": 8, "type": ..., fields...}: pinned bytes, so that a change to the wire
    format is a deliberate protocol version bump, not an accident."""
    assert PROTOCOL_VERSION == 8
    assert encode(TransferAck("r1")) == bytes.fromhex(
        "83"  # map of 3
        "a176" "08"  # "v": 8
        "a474797065" "ac7472616e736665725f61636b"  # "type": "transfer_ack"
        "aa726571756573745f6964" "a27231"  # "request_id": "r1"
    )  # fmt: skip
    plan = ReceivePlan("r", 1, [2], 3)
    assert from_dict(to_dict(plan)) == plan
    assert to_dict(plan) == {
        "v": 8,
        "type": "receive_plan",
        "request_id": "r",
        "held_blocks": 1,
        "dst_block_ids": [2],
        "dst_slot": 3,
    }


def _wire(message) -> dict:
    return msgpack.unpackb(encode(message), raw=False)


@pytest.mark.parametrize(
    ("version", "shown"), [(7, "protocol version 7 is not 8"), (None, "protocol version None")]
)
def test_another_protocol_version_is_refused(version, shown):
    data = _wire(TransferDone("r"))
    if version is None:
        del data["v"]
    else:
        data["v"] = version
    with pytest.raises(ProtocolError, match=shown) as info:
        decode(msgpack.packb(data))
    assert "same hybridserve transfer protocol" in str(info.value)


def test_an_unknown_message_type_is_refused():
    data = _wire(TransferDone("r")) | {"type": "execute_code"}
    with pytest.raises(ProtocolError, match="unknown message type 'execute_code'"):
        decode(msgpack.packb(data))
    del data["type"]
    with pytest.raises(ProtocolError, match="unknown message type None"):
        decode(msgpack.packb(data))


def test_missing_or_extra_fields_are_named():
    data = _wire(ReceivePlan("r", 0, [1], 2))
    del data["dst_slot"]
    with pytest.raises(ProtocolError, match=r"receive_plan: expected fields .*'dst_slot'"):
        decode(msgpack.packb(data))
    data = _wire(TransferAck("r")) | {"callback": "os.system"}
    with pytest.raises(ProtocolError, match=r"transfer_ack: expected fields \['request_id'\], got"):
        decode(msgpack.packb(data))


@pytest.mark.parametrize(
    ("payload", "shown"),
    [
        (b"", "not a msgpack message"),
        (b"\xc1", "not a msgpack message"),  # a byte msgpack never uses
        (msgpack.packb({"v": 1})[:-1], "not a msgpack message"),  # truncated
        (msgpack.packb({"v": 1}) + b"\x00", "not a msgpack message"),  # trailing data
        (msgpack.packb([1, "transfer_ack", "r"]), "expected a message object, got list"),
        (msgpack.packb("transfer_ack"), "expected a message object, got str"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "expected a message object, got ExtType"),
    ],
)
def test_a_malformed_payload_is_refused(payload, shown):
    with pytest.raises(ProtocolError, match=shown):
        decode(payload)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("not a layout", "ValueError"),
        ([1, 2, 3], "TypeError"),
        ({"model_id": "x"}, "KeyError: 'layer_kinds'"),  # most fields missing
        (dataclasses.asdict(LAYOUT) | {"secret": 1}, "unexpected keyword argument 'secret'"),
    ],
)
def test_a_malformed_peer_layout_is_a_protocol_error(value, shown):
    """Nested objects are the peer's input too: never a bare KeyError / TypeError."""
    data = _wire(Hello(LAYOUT, "tcp")) | {"layout": value}
    with pytest.raises(ProtocolError, match="hello: malformed") as info:
        decode(msgpack.packb(data))
    assert shown in str(info.value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("greedy", "must be a mapping, not str"),
        ([1, 2], "must be a mapping, not list"),
        ({"params": {}, "sample_seed": 0}, "missing 1 required positional argument"),
        ({"params": {}, "sample_seed": 0, "stop_token_ids": [], "hook": "x"}, "'hook'"),
    ],
)
def test_malformed_sampling_state_is_a_protocol_error(value, shown):
    data = _wire(MESSAGES[4]) | {"sampling": value}
    with pytest.raises(ProtocolError, match="transfer_request: malformed") as info:
        decode(msgpack.packb(data))
    assert shown in str(info.value)


def test_an_oversized_message_is_refused_before_parsing():
    with pytest.raises(ProtocolError, match=f"exceeds {MAX_MESSAGE_BYTES}"):
        decode(b"\x90" * (MAX_MESSAGE_BYTES + 1))


def test_a_pickle_is_never_unpickled(monkeypatch):
    """A pickle on the wire is just bytes that are not a message: decoding it must not run
    pickle (docs/failure-handling.md), whatever its payload."""

    def refuse(*args, **kwargs):
        raise AssertionError("pickle must never be called by the transceiver")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    for message in (TransferAck("r"), MESSAGES[0], {"v": 1, "type": "transfer_ack"}):
        for proto in range(pickle.HIGHEST_PROTOCOL + 1):
            with pytest.raises(ProtocolError):
                decode(pickle.dumps(message, protocol=proto))


def test_no_transceiver_module_imports_an_unpickler():
    """The wire never goes through pickle or anything built on it (docs/failure-handling.md): no
    import of pickle, cloudpickle, dill, marshal, shelve or joblib, and no torch.load."""
    forbidden = {
        "pickle",
        "cPickle",
        "_pickle",
        "cloudpickle",
        "dill",
        "marshal",
        "shelve",
        "joblib",
    }
    sources = sorted(TRANSCEIVER.glob("*.py"))
    assert {p.name for p in sources} >= {"protocol.py", "channel.py", "tcp_backend.py"}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules = {(node.module or "").split(".")[0]}
            else:
                modules = set()
            assert not modules & forbidden, f"{path.name}:{node.lineno} imports {modules}"
            if isinstance(node, ast.Attribute):
                assert ast.unparse(node) not in ("torch.load", "numpy.load", "np.load"), (
                    f"{path.name}:{node.lineno} calls {ast.unparse(node)}"
                )
