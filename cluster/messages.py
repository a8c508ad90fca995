"""Messages between the ingress and the engine actors: versioned, msgpack-ready dicts.

Ray carries them as plain dicts of ints, strings and lists (no objects of ours are pickled),
so a reader in another version fails loudly on the version field instead of misreading.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal, TypeVar

from hybridserve.workers.core.sampling_params import SamplingParams

# 2: TokenEvent carries the choice index, logprobs, prompt logprobs and the stream's end.
# 3: token events travel in TokenBatches, one per engine step and subscriber.
# 4: a prefill streams its first token's event ahead of its PrefillResult (which no longer
#    carries it).
# 5: an ingress replica reads an engine's TokenBatches from a TCP connection of their own,
#    opened with a FeedTicket from the engine actor and a FeedHello.
# 6: the replica's calls to the engine travel on that connection too (FeedCall), answered in
#    the TokenBatches (FeedReply); a prefill's first token is an event there like any other.
# 7: GenerateRequest.system_prompt_len: where a chat prompt's system messages end.
# 8: the router answers a route call with a Route or a RouteRefusal message.
# 9: a request's first TokenEvent carries its queue time in the engine (`queued_s`).
# 10: a route call carries the prompt's block chain (PromptChain), hashed at the ingress.
MESSAGES_VERSION = 10

M = TypeVar("M", bound="_Message")


class MessageError(ValueError):
    """A malformed or incompatible message."""


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


class _Message:
    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        # Shallow: the fields are plain values, and the dict is packed at once. `asdict`
        # deep-copies every list: 91 us for a 90-token GenerateRequest against 1, and 10 us
        # for a token event against 1 (an engine step sends one per stream).
        values = {name: getattr(self, name) for name in _field_names(type(self))}
        return {"v": MESSAGES_VERSION, "kind": self.kind, **values}

    @classmethod
    def from_dict(cls: type[M], data: Any) -> M:
        if not isinstance(data, dict):
            raise MessageError(f"{cls.kind}: expected a mapping, got {type(data).__name__}")
        if data.get("v") != MESSAGES_VERSION or data.get("kind") != cls.kind:
            raise MessageError(
                f"expected a {cls.kind} message of version {MESSAGES_VERSION}, got kind "
                f"{data.get('kind')!r} version {data.get('v')!r}"
            )
        names = _field_names(cls)
        values = {k: v for k, v in data.items() if k not in ("v", "kind")}
        if not names.issuperset(values):
            raise MessageError(f"{cls.kind}: unknown fields {sorted(set(values) - names)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise MessageError(f"{cls.kind}: malformed ({exc})") from exc


@dataclass(frozen=True)
class GenerateRequest(_Message):
    """One tokenized request, as the ingress sends it to an engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    cache_salt: str | None = None
    stable_prompt_len: int | None = None  # ChatPrompt.stable_len
    system_prompt_len: int | None = None  # ChatPrompt.system_len
    kind: ClassVar[str] = "generate"

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(**self.sampling)


@dataclass(frozen=True)
class TokenEvent(_Message):
    """New tokens of choice `index` of a request; `offset` is the output position of the first
    of them in that choice, so a reader can drop tokens it already has (a recompute
    regenerates the same ones). `finish_reason` ends the choice; the request's stream ends
    with the event marked `last` (every choice finished), or with an error or abort."""

    request_id: str
    offset: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Literal["stop", "length", "abort", "error"] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0
    last: bool = False
    # With logprobs: one [token id, logprob, [[id, logprob], ...]] per token of token_ids.
    logprobs: list[list[Any]] | None = None
    # With prompt_logprobs, on the first event: one per prompt token (None for the first).
    prompt_logprobs: list[list[Any] | None] | None = None
    # On the first event: how long the request waited in the engine before it was scheduled.
    queued_s: float | None = None
    kind: ClassVar[str] = "tokens"

    @property
    def finished(self) -> bool:
        """No event follows: the stream of the whole request is over."""
        return self.last or self.finish_reason in ("error", "abort")

    def joined(self, following: TokenEvent) -> TokenEvent | None:
        """This event and the one after it as one event, when they continue each other (the
        same choice, `following` starting where this one ends, neither carrying an end or
        an error before the last token); else None."""
        if (
            following.request_id != self.request_id
            or following.index != self.index
            or following.offset != self.offset + len(self.token_ids)
            or self.finish_reason is not None
            or self.error is not None
            or self.last
            or (self.logprobs is None) != (following.logprobs is None)
            or following.prompt_logprobs is not None
            or following.queued_s is not None
        ):
            return None
        logprobs = None
        if self.logprobs is not None and following.logprobs is not None:
            logprobs = [*self.logprobs, *following.logprobs]
        return replace(
            following,
            offset=self.offset,
            token_ids=[*self.token_ids, *following.token_ids],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            queued_s=self.queued_s,
        )


@dataclass(frozen=True)
class PrefillResult(_Message):
    """What a prefill engine did with a request: the reply to its prefill call. The first
    token's TokenEvent goes out on its own, as soon as the token exists.

    status: "handed_off" (decode acked the transfer), "finished" (it ended with its first
    token; nothing to transfer), "transfer_failed" (decode never admitted it: recompute
    there), or "error" (the request itself was refused; `detail` says why)."""

    request_id: str
    status: Literal["handed_off", "finished", "transfer_failed", "error"]
    detail: str = ""
    blocks_sent: int = 0
    blocks_held: int = 0
    bytes_sent: int = 0
    kind: ClassVar[str] = "prefill_result"


@dataclass(frozen=True)
class Route(_Message):
    """Where one request runs, as the router chose it. `prefill` None: the decode engine
    prefills it itself. `incarnations`: the chosen engines' incarnations (a restarted engine is
    a new one under the same name), so a caller holding an older handle can tell."""

    prefill: str | None
    decode: str
    expected_cached_tokens: int
    reason: str
    incarnations: dict[str, int] = field(default_factory=dict)
    kind: ClassVar[str] = "route"

    @property
    def engines(self) -> list[str]:
        """The engines this route holds load on (each to be released once)."""
        return [name for name in (self.prefill, self.decode) if name is not None]


@dataclass(frozen=True)
class PromptChain(_Message):
    """A prompt as the router looks it up (cluster/routing/prefix_index.py), hashed once where
    the request is tokenised: `tokens`, the prompt less its last token (always computed), and
    `chain`, the salt's root key and then the key of each full `block_size`-token block."""

    tokens: list[int]
    chain: list[bytes]
    block_size: int
    kind: ClassVar[str] = "prompt_chain"


@dataclass(frozen=True)
class RouteRefusal(_Message):
    """The router's answer when no engine takes a request now: `status` 429 (its queue is
    full) or 503 (no decode engine is alive); nothing was allocated for it."""

    status: int
    message: str
    kind: ClassVar[str] = "route_refusal"


@dataclass(frozen=True)
class FeedCall(_Message):
    """An ingress replica's call to an engine, on its token feed connection
    (cluster/transport/token_feed.py): `method` and `args` as the engine's `TokenOutbox` takes them
    (cluster/transport/feed_server.py). Answered by the FeedReply with the same `call_id`."""

    call_id: int
    method: str
    args: list[Any]
    kind: ClassVar[str] = "feed_call"


@dataclass(frozen=True)
class FeedReply(_Message):
    """The answer to a FeedCall: its `value`, or `error` (what went wrong, for the caller to
    raise)."""

    call_id: int
    value: Any = None
    error: str | None = None
    kind: ClassVar[str] = "feed_reply"


@dataclass(frozen=True)
class TokenBatch(_Message):
    """The token events one engine produced in one step for the requests of one subscriber
    (an ingress replica), and the replies to its calls that are ready: one message per step,
    not one per request and token."""

    events: list[TokenEvent]
    replies: list[FeedReply] = field(default_factory=list)
    kind: ClassVar[str] = "token_batch"

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": MESSAGES_VERSION,
            "kind": self.kind,
            "events": [event.to_dict() for event in self.events],
            "replies": [reply.to_dict() for reply in self.replies],
        }

    @classmethod
    def from_dict(cls, data: Any) -> TokenBatch:
        if isinstance(data, dict) and isinstance(data.get("events"), list):
            data = data | {"events": [TokenEvent.from_dict(e) for e in data["events"]]}
        if isinstance(data, dict) and isinstance(data.get("replies"), list):
            data = data | {"replies": [FeedReply.from_dict(r) for r in data["replies"]]}
        return super().from_dict(data)


@dataclass(frozen=True)
class FeedTicket(_Message):
    """Where an ingress replica reads an engine's token batches (cluster/transport/token_feed.py),
    and the one-time ticket that opens its connection there."""

    host: str
    port: int
    ticket: str
    kind: ClassVar[str] = "feed_ticket"


@dataclass(frozen=True)
class FeedHello(_Message):
    """The first frame an ingress replica sends on its token feed connection."""

    ticket: str
    kind: ClassVar[str] = "feed_hello"
