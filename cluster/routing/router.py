"""The router: which engine prefills a request and which decodes it.

Policies (selectable, so benchmarks can compare them side by side in one run):

- `snapshot-aware` (default): score every engine by what a hybrid model can really reuse
  there (`PrefixIndex`, deepest usable snapshot), minus its load. The decode engine that
  served a conversation's previous turn holds a turn-end snapshot; if the uncached suffix on
  it is short (`decode_prefill_threshold`), it prefills the request itself (conditional
  disaggregation), otherwise the best prefill engine computes only what it lacks and ships
  to the holder, which already has most blocks.
- `attention-only`: what peers do: prefill scored by the attention block match, decode by
  load alone.
- `least-load`: the least loaded engines, whatever they hold (what a plain load balancer does).
- `round-robin`: cycles through prefill engines and decode engines independently.

Without prefill engines (a colocated deployment) the decode engines do everything and are
scored the same way.

Admission comes first. A request is queued when the decode engines already run as many
requests as they have sequence slots (`max_num_seqs` each); once `max_queued_requests` wait,
the next request is refused (`RouteRefused`, a 429 for the client) before anything is
allocated for it anywhere:

    in flight on the decode engines:  [ running: Σ max_num_seqs | queued: ≤ max_queued ] + new?
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridserve.cluster.messages import PromptChain, Route, RouteRefusal
from hybridserve.cluster.routing.engine_loads import EngineLoads
from hybridserve.cluster.routing.prefix_index import PrefixIndex, Reuse

logger = logging.getLogger(__name__)

Policy = Literal["snapshot-aware", "attention-only", "least-load", "round-robin"]


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: Policy = Field("snapshot-aware", description="how engines are chosen")
    decode_prefill_threshold: int = Field(
        256,
        ge=0,
        description="a decode engine holding a conversation prefills the next turn itself "
        "when at most this many prompt tokens are uncached there",
    )
    load_cost_tokens: int = Field(
        128,
        ge=0,
        description="a request in flight on an engine weighs as much as this many reused "
        "tokens when engines are compared",
    )


class RouteRefused(Exception):
    """No engine takes the request now: `status` 429 (queue full, retry later) or 503 (no
    decode engine is alive)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def to_message(self) -> RouteRefusal:
        return RouteRefusal(self.status, self.message)


class Router:
    def __init__(
        self,
        config: RouterConfig,
        index: PrefixIndex,
        prefill_engines: Sequence[str],
        decode_engines: Mapping[str, int],
        max_queued_requests: int | None = None,
    ) -> None:
        """`decode_engines`: each decode engine's `max_num_seqs`; `max_queued_requests`: None
        for an unbounded queue. The engines are added to `index` too."""
        self.config = config
        self.index = index
        self.prefill = EngineLoads()
        self.decode = EngineLoads()
        self.capacity: dict[str, int] = {}
        self.max_queued_requests = max_queued_requests
        self.incarnations: dict[str, int] = {}
        for name in prefill_engines:
            self.add_engine(name, capacity=None, incarnation=0)
        for name, capacity in decode_engines.items():
            self.add_engine(name, capacity=capacity, incarnation=0)
        self._turns = itertools.count()

    @property
    def engines(self) -> list[str]:
        return [*self.prefill.names, *self.decode.names]

    def loads(self) -> dict[str, int]:
        return self.prefill.loads() | self.decode.loads()

    def set_policy(self, policy: Policy) -> None:
        self.config = self.config.model_copy(update={"policy": policy})
        self._turns = itertools.count()

    def remove_engine(self, name: str) -> None:
        """A dead engine: never routed to again, and its index entries are dropped."""
        self.prefill.remove(name)
        self.decode.remove(name)
        self.capacity.pop(name, None)
        self.index.remove_engine(name)

    def add_engine(self, name: str, *, capacity: int | None, incarnation: int) -> None:
        """A (re)started engine: routable again, with an empty index (`capacity`: its
        max_num_seqs for a decode engine, None for a prefill engine)."""
        self.remove_engine(name)
        slot = self.index.add_engine(name)
        if capacity is None:
            self.prefill.add(name, slot)
        else:
            self.decode.add(name, slot)
            self.capacity[name] = capacity
        self.incarnations[name] = incarnation

    def route(self, prompt: PromptChain) -> Route:
        """Choose engines and count the request against their load (`release` each)."""
        self._admit()
        policy = self.config.policy
        if policy == "round-robin":
            route = self._round_robin()
        elif policy == "least-load":
            route = self._least_loaded()
        else:
            route = self._scored(
                len(prompt.tokens) + 1,
                self.index.match(prompt),
                snapshot_aware=policy != "attention-only",
            )
        for engine in route.engines:
            self._loads(engine).change(engine, +1)
        return replace(route, incarnations={e: self.incarnations[e] for e in route.engines})

    def _loads(self, engine: str) -> EngineLoads:
        return self.prefill if engine in self.prefill else self.decode

    def num_queued(self, extra: int = 0) -> int:
        """Requests in flight (plus `extra`) beyond what the decode engines run at once."""
        return max(0, self.decode.total + extra - sum(self.capacity.values()))

    def _admit(self) -> None:
        if not len(self.decode):
            raise RouteRefused(503, "no decode engine is alive; retry once one is back")
        limit = self.max_queued_requests
        if limit is not None and self.num_queued(extra=1) > limit:
            raise RouteRefused(
                429,
                f"the service is at capacity: {self.num_queued()} requests are queued "
                f"(max_queued_requests={limit}); retry later",
            )

    def release(self, engine: str) -> None:
        """One request no longer runs on `engine` (prefill: handed off; decode: finished)."""
        self._loads(engine).change(engine, -1)

    def _round_robin(self) -> Route:
        turn = next(self._turns)
        decode = self.decode.at(turn)
        if not len(self.prefill):
            return Route(None, decode, 0, "round-robin")
        prefill = self.prefill.at(turn)
        return Route(prefill, decode, 0, "round-robin")

    def _least_loaded(self) -> Route:
        turn, cost = next(self._turns), max(1, self.config.load_cost_tokens)
        decode, _ = self.decode.best([], turn, cost)
        if not len(self.prefill):
            return Route(None, decode, 0, "least-load")
        return Route(self.prefill.best([], turn, cost)[0], decode, 0, "least-load")

    def _scored(self, num_tokens: int, match: Reuse, *, snapshot_aware: bool) -> Route:
        turn = next(self._turns)
        cost = self.config.load_cost_tokens
        reuse = match.snapshot if snapshot_aware else match.attention
        if not len(self.prefill):
            decode, cached = self.decode.best(reuse, turn, cost)
            return Route(None, decode, cached, "colocated")
        if not snapshot_aware:
            decode, _ = self.decode.best([], turn, cost)
            prefill, cached = self.prefill.best(reuse, turn, cost)
            return Route(prefill, decode, cached, "attention-match")
        decode, held = self.decode.best(reuse, turn, cost)
        if held > 0 and num_tokens - held <= self.config.decode_prefill_threshold:
            return Route(None, decode, held, "decode-holder")
        prefill, cached = self.prefill.best(reuse, turn, cost)
        return Route(prefill, decode, cached, "snapshot-match")
