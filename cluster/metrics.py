"""Prometheus metrics for GET /metrics.

What vLLM also measures is exported under vLLM's own names and types (`vllm:`), so that its
Grafana dashboards, KEDA rules and llm-d's scorers find it unchanged; what only hybridserve
measures (snapshots, transfers, the global prefix index, refusals, leak detectors) is under
`hybridserve:`. Each quantity has one name.

Values come from three places:

- the ingress, once per finished request (`ServiceMetrics.observe_request`): token counters,
  prefix-cache queries and hits (token units), `request_success{finished_reason}`, the
  latency (queue, prefill, decode, inference, end to end) and length histograms, and once per
  refused request (`observe_refusal`); labels `model_name`.
- the engines, as a periodic report (`ServiceMetrics.update_engines`, one `EngineStats` per
  engine): their gauges, cumulative counters and transfer-time histogram, exported at scrape
  time exactly as last reported; labels `model_name`, `engine`.
- the global prefix index (`ServiceMetrics.set_prefix_index`): its size; labels `model_name`.

Everything lives on a private `CollectorRegistry`, so several services (or tests) in one process
never share series.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field

from hybridserve.workers.core.outputs import FinishReason

VLLM = "vllm:"
OURS = "hybridserve:"
# NOTE: the classic text format, which every Prometheus parses; our names need no escaping, so
# the body is the same one newer clients label `version=1.0.0`.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Buckets as vLLM's (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# A KV + state transfer between engines: local links take milliseconds, remote ones more.
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0)  # fmt: skip
# Requests refused before they ran (`OpenAIError` codes): too many queued (429), no engine
# to run them (503).
REFUSAL_REASONS = ("overloaded", "no_engine")

_FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")


class HistogramCounts(BaseModel):
    """A histogram an engine keeps and reports: cumulative counts per bucket bound (the last
    one +Inf), with their sum. Observed where the engine measures; exported at scrape time."""

    model_config = ConfigDict(extra="ignore")

    bounds: tuple[float, ...] = TRANSFER_BUCKETS
    counts: list[int] = Field(default_factory=list)  # per bound, then +Inf; not cumulative
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        index = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, as Prometheus reads them."""
        counts = self.counts or [0] * (len(self.bounds) + 1)
        running, out = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            running += count
            out.append((bound, running))
        return out


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineStats(BaseModel):
    """One engine's report, as a plain dict: `EngineStats.model_validate(engine.stats())`.

    Gauges are the engine's state now; the rest are cumulative totals since the engine started
    (a restart starts them over, which Prometheus' `rate()` reads as a counter reset). Fields a
    newer engine adds are ignored; fields it lacks read 0.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Gauges.
    num_requests_running: int = Field(0, ge=0)
    num_requests_waiting: int = Field(0, ge=0)
    kv_cache_usage_perc: float = Field(0.0, ge=0.0, le=1.0, description="1.0 = 100%")
    kv_blocks_in_use: int = Field(0, ge=0, description="held, not cached-and-free")
    state_slots_in_use: int = Field(0, ge=0, description="live-state slots held")
    transfers_in_flight: int = Field(0, ge=0, description="sends and receives under way")
    handoffs_held: int = Field(0, ge=0, description="prefill requests held for a transfer")
    # Cumulative totals.
    num_preemptions: int = Field(0, ge=0)
    num_requests_aborted: int = Field(0, ge=0, description="live requests aborted")
    snapshot_hits: int = Field(0, ge=0, description="Mamba snapshots found for a prefix hit")
    snapshot_misses: int = Field(0, ge=0, description="prefix lookups with no usable snapshot")
    reused_tokens: int = Field(0, ge=0, description="prompt tokens not recomputed")
    transfer_bytes: int = Field(0, ge=0, description="KV + Mamba state bytes moved")
    transfer_failures: dict[str, int] = Field(default_factory=dict, description="by reason")
    transfer_links_refused: dict[str, int] = Field(
        default_factory=dict, description="links closed in their handshake, by reason"
    )
    integrity_failures: int = Field(0, ge=0, description="idle pool recounts that failed")
    # Speculative decoding (vLLM's spec_decode_* counters).
    spec_decode_num_drafts: int = Field(0, ge=0, description="verify steps")
    spec_decode_num_draft_tokens: int = Field(0, ge=0, description="draft tokens verified")
    spec_decode_num_accepted_tokens: int = Field(0, ge=0, description="draft tokens accepted")
    spec_decode_num_accepted_tokens_per_pos: list[int] = Field(
        default_factory=list, description="accepted drafts by their offset in the span"
    )
    transfer_time_seconds: HistogramCounts = Field(
        default_factory=HistogramCounts, description="sends, first byte to the receiver's ack"
    )


# name -> (prefix, help): vLLM's names for what vLLM measures too.
_ENGINE_GAUGES = {
    "num_requests_running": (VLLM, "Requests in the engine's running batch."),
    "num_requests_waiting": (VLLM, "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": (VLLM, "Fraction of KV-cache blocks in use (1.0 = 100%)."),
    # Leak detectors: all 0 on an idle engine.
    "kv_blocks_in_use": (OURS, "KV blocks held by requests, hand-offs, receives or quarantine."),
    "state_slots_in_use": (
        OURS,
        "Recurrent-state live slots held by requests, hand-offs or receives.",
    ),
    "transfers_in_flight": (OURS, "KV/state transfers being sent or received."),
    "handoffs_held": (OURS, "Prefilled requests holding their pages for a transfer."),
}
_ENGINE_COUNTERS = {
    "num_preemptions": (VLLM, "Requests preempted by the scheduler."),
    "num_requests_aborted": (
        OURS,
        "Live requests aborted on the engine (their client left, a stop string ended them, "
        "or an abort call).",
    ),
    "snapshot_hits": (OURS, "Prefix hits that found a recurrent-state snapshot."),
    "snapshot_misses": (OURS, "Prefix lookups that found no usable recurrent-state snapshot."),
    "reused_tokens": (OURS, "Prompt tokens reused instead of recomputed."),
    "transfer_bytes": (OURS, "Bytes of KV and recurrent state transferred."),
    "integrity_failures": (OURS, "Idle-time cache recounts that found the pools inconsistent."),
    "spec_decode_num_drafts": (
        VLLM,
        "Speculative decoding: verify steps (one per request per step).",
    ),
    "spec_decode_num_draft_tokens": (VLLM, "Speculative decoding: draft tokens verified."),
    "spec_decode_num_accepted_tokens": (VLLM, "Speculative decoding: draft tokens accepted."),
}
_ENGINE_COUNTERS_BY_REASON = {
    "transfer_failures": "Failed transfers, by reason.",
    # Alert on unauthenticated: something that is not an engine of this deployment connects.
    "transfer_links_refused": "Transfer links refused in their handshake (unauthenticated, "
    "layout_mismatch, malformed), by reason.",
}


class _EngineCollector(Collector):
    """Exports the latest engine reports at scrape time (counters are totals, not increments)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engines: Mapping[str, EngineStats] = {}  # replaced whole, never mutated

    def collect(self) -> Iterator[Metric]:
        engines = self.engines  # one consistent report per scrape
        labels = ["model_name", "engine"]
        for name, (prefix, doc) in _ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(prefix + name, doc, labels=labels)
            for engine, stats in engines.items():
                gauge.add_metric([self.model_name, engine], getattr(stats, name))
            yield gauge
        for name, (prefix, doc) in _ENGINE_COUNTERS.items():
            counter = CounterMetricFamily(prefix + name, doc, labels=labels)
            for engine, stats in engines.items():
                counter.add_metric([self.model_name, engine], getattr(stats, name))
            yield counter
        for name, doc in _ENGINE_COUNTERS_BY_REASON.items():
            counter = CounterMetricFamily(OURS + name, doc, labels=[*labels, "reason"])
            for engine, stats in engines.items():
                for reason, count in sorted(getattr(stats, name).items()):
                    counter.add_metric([self.model_name, engine, reason], count)
            yield counter
        # Acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted /
        # drafts (vLLM's dashboard derives both from these counters the same way).
        counter = CounterMetricFamily(
            VLLM + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by their offset in the span.",
            labels=[*labels, "position"],
        )
        for engine, stats in engines.items():
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                counter.add_metric([self.model_name, engine, str(position)], count)
        yield counter
        histogram = HistogramMetricFamily(
            OURS + "transfer_time_seconds",
            "KV and recurrent-state transfers a prefill engine sent: first byte to the decode "
            "engine's ack.",
            labels=labels,
        )
        for engine, stats in engines.items():
            times = stats.transfer_time_seconds
            histogram.add_metric([self.model_name, engine], times.buckets(), times.total)
        yield histogram


class ServiceMetrics:
    """The service's metrics on a private registry; `render()` is the GET /metrics body."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        self._engines = _EngineCollector(model_name)
        self.registry.register(self._engines)

        def counter(name: str, doc: str, prefix: str = VLLM) -> Counter:
            return Counter(prefix + name, doc, ["model_name"], registry=self.registry)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(
                VLLM + name, doc, ["model_name"], registry=self.registry, buckets=buckets
            )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(OURS + name, doc, ["model_name"], registry=self.registry)

        model = {"model_name": model_name}
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self._generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self._request_success = Counter(
            VLLM + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._refused = Counter(
            OURS + "requests_refused",
            "Requests refused before they ran: overloaded (429, too many queued) or no_engine "
            "(503, no engine to run them).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self._ttft = histogram(
            "time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS
        )
        self._itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self._e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to finish.", E2E_BUCKETS
        )
        self._queue = histogram(
            "request_queue_time_seconds",
            "Time a request waited in its (prefill) engine before its prompt was scheduled.",
            E2E_BUCKETS,
        )
        self._prefill = histogram(
            "request_prefill_time_seconds",
            "Time from a request's scheduling to its first token.",
            E2E_BUCKETS,
        )
        self._decode = histogram(
            "request_decode_time_seconds",
            "Time from a request's first token to its last.",
            E2E_BUCKETS,
        )
        self._inference = histogram(
            "request_inference_time_seconds",
            "Time from a request's scheduling to its last token (prefill + decode).",
            E2E_BUCKETS,
        )
        length_buckets = token_buckets(max_model_len)
        self._request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length per request.", length_buckets
        )
        self._request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", length_buckets
        )
        self._max_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of a request's longest choice.",
            length_buckets,
        )
        self._index_blocks = gauge("prefix_index_blocks", "Blocks in the global prefix index.")
        self._index_snapshots = gauge(
            "prefix_index_snapshots", "Recurrent-state snapshots in the global prefix index."
        )
        # Bind the label values once; series exist (at 0) from the first scrape, as in vLLM.
        for metric in (
            self._prompt_tokens,
            self._generation_tokens,
            self._prefix_cache_queries,
            self._prefix_cache_hits,
            self._ttft,
            self._itl,
            self._e2e,
            self._queue,
            self._prefill,
            self._decode,
            self._inference,
            self._request_prompt_tokens,
            self._request_generation_tokens,
            self._max_generation_tokens,
            self._index_blocks,
            self._index_snapshots,
        ):
            metric.labels(**model)
        for reason in _FINISH_REASONS:
            self._request_success.labels(model_name=model_name, finished_reason=reason)
        for reason in REFUSAL_REASONS:
            self._refused.labels(model_name=model_name, reason=reason)
        self._model = model

    def observe_request(
        self,
        *,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int,
        finish_reason: FinishReason,
        e2e_s: float,
        ttft_s: float | None = None,
        itl_s: Sequence[float] = (),
        queued_s: float | None = None,
        max_generation_tokens: int | None = None,
    ) -> None:
        """Record one finished request. `ttft_s` is None when no token came back; `itl_s` holds
        the gaps between consecutive streamed tokens; `queued_s` is the engine's wait before
        scheduling it (None when no engine reported one)."""
        assert 0 <= cached_tokens <= prompt_tokens, (cached_tokens, prompt_tokens)
        model = self._model
        self._prompt_tokens.labels(**model).inc(prompt_tokens)
        self._generation_tokens.labels(**model).inc(generation_tokens)
        self._prefix_cache_queries.labels(**model).inc(prompt_tokens)
        self._prefix_cache_hits.labels(**model).inc(cached_tokens)
        self._request_success.labels(**model, finished_reason=finish_reason).inc()
        self._request_prompt_tokens.labels(**model).observe(prompt_tokens)
        self._request_generation_tokens.labels(**model).observe(generation_tokens)
        longest = generation_tokens if max_generation_tokens is None else max_generation_tokens
        self._max_generation_tokens.labels(**model).observe(longest)
        self._e2e.labels(**model).observe(e2e_s)
        if ttft_s is not None:
            self._ttft.labels(**model).observe(ttft_s)
            self._decode.labels(**model).observe(max(0.0, e2e_s - ttft_s))
            if queued_s is not None:
                self._queue.labels(**model).observe(queued_s)
                self._prefill.labels(**model).observe(max(0.0, ttft_s - queued_s))
                self._inference.labels(**model).observe(max(0.0, e2e_s - queued_s))
        itl = self._itl.labels(**model)
        for gap in itl_s:
            itl.observe(gap)

    def observe_refusal(self, reason: str) -> None:
        """A request refused before it ran (`REFUSAL_REASONS`)."""
        self._refused.labels(**self._model, reason=reason).inc()

    def update_engines(self, stats: Mapping[str, EngineStats | Mapping[str, object]]) -> None:
        """Replace all engine reports: engine name -> `EngineStats` (or its plain dict).

        Engines missing from `stats` drop out of the next scrape. Raises pydantic's
        `ValidationError` for a malformed report, before anything changes.
        """
        self._engines.engines = {
            engine: EngineStats.model_validate(report) for engine, report in stats.items()
        }

    def set_prefix_index(self, num_blocks: int, num_snapshots: int) -> None:
        self._index_blocks.labels(**self._model).set(num_blocks)
        self._index_snapshots.labels(**self._model).set(num_snapshots)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE
