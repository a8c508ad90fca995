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
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridserve.cluster.messages import Route, RouteRefusal
from hybridserve.cluster.routing.prefix_index import PrefixIndex, ReuseScore

logger = logging.getLogger(__name__)

Policy = Literal["snapshot-aware", "attention-only", "round-robin"]


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
        for an unbounded queue."""
        self.config = config
        self.index = index
        self.prefill_engines = list(prefill_engines)
        self.decode_engines = list(decode_engines)
        self.capacity = dict(decode_engines)
        self.max_queued_requests = max_queued_requests
        self.incarnations = dict.fromkeys([*prefill_engines, *decode_engines], 0)
        self.load: Counter[str] = Counter()
        self._turns = itertools.count()

    def set_policy(self, policy: Policy) -> None:
        self.config = self.config.model_copy(update={"policy": policy})
        self._turns = itertools.count()

    def remove_engine(self, name: str) -> None:
        """A dead engine: never routed to again, and its index entries are dropped."""
        for engines in (self.prefill_engines, self.decode_engines):
            if name in engines:
                engines.remove(name)
        self.capacity.pop(name, None)
        self.load.pop(name, None)
        self.index.remove_engine(name)

    def route(self, token_ids: Sequence[int], cache_salt: str | None) -> Route:
        """Choose engines and count the request against their load (`release` each)."""
        self._admit()
        policy = self.config.policy
        if policy == "round-robin":
            route = self._round_robin()
        else:
            scores = self.index.score(token_ids, cache_salt)
            route = self._scored(len(token_ids), scores, snapshot_aware=policy != "attention-only")
        for engine in route.engines:
            self.load[engine] += 1
        return replace(route, incarnations={e: self.incarnations[e] for e in route.engines})

    def add_engine(self, name: str, *, capacity: int | None, incarnation: int) -> None:
        """A (re)started engine: routable again, with an empty index (`capacity`: its
        max_num_seqs for a decode engine, None for a prefill engine)."""
        self.remove_engine(name)
        if capacity is None:
            self.prefill_engines.append(name)
        else:
            self.decode_engines.append(name)
            self.capacity[name] = capacity
        self.incarnations[name] = incarnation

    def num_queued(self, extra: int = 0) -> int:
        """Requests in flight (plus `extra`) beyond what the decode engines run at once."""
        running = sum(self.capacity[e] for e in self.decode_engines)
        return max(0, sum(self.load[e] for e in self.decode_engines) + extra - running)

    def _admit(self) -> None:
        if not self.decode_engines:
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
        if self.load[engine] > 0:
            self.load[engine] -= 1

    def _round_robin(self) -> Route:
        turn = next(self._turns)
        decode = self.decode_engines[turn % len(self.decode_engines)]
        if not self.prefill_engines:
            return Route(None, decode, 0, "round-robin")
        prefill = self.prefill_engines[turn % len(self.prefill_engines)]
        return Route(prefill, decode, 0, "round-robin")

    def _best(self, engines: list[str], reuse: dict[str, int], turn: int) -> tuple[str, int]:
        """Highest reuse minus load; ties go round the engines."""
        cost = self.config.load_cost_tokens
        order = {e: (i - turn) % len(engines) for i, e in enumerate(engines)}
        best = max(engines, key=lambda e: (reuse.get(e, 0) - cost * self.load[e], -order[e]))
        return best, reuse.get(best, 0)

    def _scored(
        self, num_tokens: int, scores: dict[str, ReuseScore], *, snapshot_aware: bool
    ) -> Route:
        turn = next(self._turns)
        if snapshot_aware:
            reuse = {name: s.snapshot_tokens for name, s in scores.items()}
        else:
            reuse = {name: s.attention_tokens for name, s in scores.items()}
        if not self.prefill_engines:
            decode, cached = self._best(self.decode_engines, reuse, turn)
            return Route(None, decode, cached, "colocated")
        if not snapshot_aware:
            decode, _ = self._best(self.decode_engines, {}, turn)
            prefill, cached = self._best(self.prefill_engines, reuse, turn)
            return Route(prefill, decode, cached, "attention-match")
        decode, held = self._best(self.decode_engines, reuse, turn)
        if held > 0 and num_tokens - held <= self.config.decode_prefill_threshold:
            return Route(None, decode, held, "decode-holder")
        prefill, cached = self._best(self.prefill_engines, reuse, turn)
        return Route(prefill, decode, cached, "snapshot-match")
