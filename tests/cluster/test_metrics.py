"""GET /metrics: names, labels and values after observations, parsed as Prometheus reads them."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from hybridserve.cluster.metrics import EngineStats, ServiceMetrics, token_buckets


def scrape(metrics: ServiceMetrics) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of one scrape."""
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def labels(**values: str) -> frozenset:
    return frozenset({"model_name": "tiny", **values}.items())


def test_series_exist_at_zero_before_any_request():
    samples = scrape(ServiceMetrics("tiny", max_model_len=64))
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "hybridserve:prefix_index_blocks",
        "hybridserve:prefix_index_snapshots",
    ):
        assert samples[(name, labels())] == 0.0, name
    for reason in ("stop", "length", "abort", "error"):
        key = ("vllm:request_success_total", labels(finished_reason=reason))
        assert samples[key] == 0.0


def test_observe_request():
    metrics = ServiceMetrics("tiny", max_model_len=64)
    metrics.observe_request(
        prompt_tokens=10,
        generation_tokens=4,
        cached_tokens=8,
        finish_reason="stop",
        e2e_s=0.7,
        ttft_s=0.05,
        itl_s=[0.02, 0.03, 0.2],
        queued_s=0.01,
        max_generation_tokens=6,
    )
    metrics.observe_request(
        prompt_tokens=30, generation_tokens=0, cached_tokens=0, finish_reason="error", e2e_s=0.1
    )
    samples = scrape(metrics)
    expected = {
        "vllm:prompt_tokens_total": 40,
        "vllm:generation_tokens_total": 4,
        "vllm:prefix_cache_queries_total": 40,
        "vllm:prefix_cache_hits_total": 8,
        "vllm:time_to_first_token_seconds_count": 1,
        "vllm:time_to_first_token_seconds_sum": 0.05,
        "vllm:inter_token_latency_seconds_count": 3,
        "vllm:inter_token_latency_seconds_sum": 0.25,
        "vllm:e2e_request_latency_seconds_count": 2,
        "vllm:e2e_request_latency_seconds_sum": 0.8,
        "vllm:request_prompt_tokens_sum": 40,
        "vllm:request_generation_tokens_sum": 4,
        # vLLM's phases: queued 0.01, prefill until the first token, decode until the end.
        "vllm:request_queue_time_seconds_sum": 0.01,
        "vllm:request_prefill_time_seconds_sum": 0.04,
        "vllm:request_decode_time_seconds_sum": 0.65,
        "vllm:request_inference_time_seconds_sum": 0.69,
        "vllm:request_queue_time_seconds_count": 1,  # the failed request had no first token
        "vllm:request_max_num_generation_tokens_sum": 6,
    }
    for name, value in expected.items():
        assert samples[(name, labels())] == pytest.approx(value), name
    success = "vllm:request_success_total"
    assert samples[(success, labels(finished_reason="stop"))] == 1
    assert samples[(success, labels(finished_reason="error"))] == 1
    assert samples[(success, labels(finished_reason="length"))] == 0
    # Buckets are cumulative: 0.02 and 0.03 fall at or under 0.05, 0.2 does not.
    itl_bucket = "vllm:inter_token_latency_seconds_bucket"
    assert samples[(itl_bucket, labels(le="0.05"))] == 2
    assert samples[(itl_bucket, labels(le="0.2"))] == 3
    prompt_bucket = "vllm:request_prompt_tokens_bucket"
    assert samples[(prompt_bucket, labels(le="10.0"))] == 1
    assert samples[(prompt_bucket, labels(le="50.0"))] == 2


def test_engine_reports_are_exported_as_last_reported():
    metrics = ServiceMetrics("tiny", max_model_len=64)
    metrics.update_engines(
        {
            "prefill-0": {
                "num_requests_running": 3,
                "num_requests_waiting": 1,
                "kv_cache_usage_perc": 0.25,
                "num_preemptions": 2,
                "snapshot_hits": 7,
                "snapshot_misses": 1,
                "reused_tokens": 512,
                "transfer_bytes": 4096,
                "transfer_failures": {"timeout": 2, "peer_died": 1},
                "added_by_a_newer_engine": 1,
            },
            "decode-0": EngineStats(
                num_requests_running=5,
                transfer_links_refused={"unauthenticated": 3},
                spec_decode_num_drafts=10,
                spec_decode_num_draft_tokens=40,
                spec_decode_num_accepted_tokens=25,
                spec_decode_num_accepted_tokens_per_pos=[9, 8, 5, 3],
            ),
        }
    )
    metrics.set_prefix_index(num_blocks=12, num_snapshots=3)
    samples = scrape(metrics)
    prefill, decode = labels(engine="prefill-0"), labels(engine="decode-0")
    assert samples[("vllm:num_requests_running", prefill)] == 3
    assert samples[("vllm:num_requests_running", decode)] == 5
    assert samples[("vllm:num_requests_waiting", prefill)] == 1
    assert samples[("vllm:kv_cache_usage_perc", prefill)] == 0.25
    assert samples[("vllm:num_preemptions_total", prefill)] == 2
    assert samples[("hybridserve:snapshot_hits_total", prefill)] == 7
    assert samples[("hybridserve:snapshot_misses_total", prefill)] == 1
    assert samples[("hybridserve:reused_tokens_total", prefill)] == 512
    assert samples[("hybridserve:transfer_bytes_total", prefill)] == 4096
    assert samples[("hybridserve:transfer_bytes_total", decode)] == 0
    failures = "hybridserve:transfer_failures_total"
    assert samples[(failures, labels(engine="prefill-0", reason="timeout"))] == 2
    assert samples[(failures, labels(engine="prefill-0", reason="peer_died"))] == 1
    refused = "hybridserve:transfer_links_refused_total"
    assert samples[(refused, labels(engine="decode-0", reason="unauthenticated"))] == 3
    assert samples[("vllm:spec_decode_num_drafts_total", decode)] == 10
    assert samples[("vllm:spec_decode_num_draft_tokens_total", decode)] == 40
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", decode)] == 25
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert samples[(per_position, labels(engine="decode-0", position="2"))] == 5
    assert (per_position, labels(engine="prefill-0", position="0")) not in samples
    assert samples[("hybridserve:prefix_index_blocks", labels())] == 12
    assert samples[("hybridserve:prefix_index_snapshots", labels())] == 3

    # Totals are replaced, not added; an engine that stops reporting drops out.
    metrics.update_engines({"prefill-0": {"snapshot_hits": 9}})
    samples = scrape(metrics)
    assert samples[("hybridserve:snapshot_hits_total", prefill)] == 9
    assert ("vllm:num_requests_running", decode) not in samples


def test_malformed_engine_report_changes_nothing():
    metrics = ServiceMetrics("tiny", max_model_len=64)
    metrics.update_engines({"e0": {"num_requests_running": 1}})
    with pytest.raises(ValidationError):
        metrics.update_engines(
            {"e0": {"num_requests_running": 2}, "e1": {"kv_cache_usage_perc": 2}}
        )
    assert scrape(metrics)[("vllm:num_requests_running", labels(engine="e0"))] == 1


def test_registries_are_private():
    first, second = ServiceMetrics("tiny", 64), ServiceMetrics("tiny", 64)
    first.observe_request(
        prompt_tokens=3, generation_tokens=1, cached_tokens=0, finish_reason="length", e2e_s=1.0
    )
    assert scrape(second)[("vllm:prompt_tokens_total", labels())] == 0


def test_token_buckets():
    assert token_buckets(64) == (1, 2, 5, 10, 20, 50)
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


class _Service:
    """The routes' view of a service, for the page alone (no engines behind it)."""

    async def model(self) -> dict:
        return {"model_id": "tiny", "max_model_len": 64, "vocab_size": 259, "eos_token_ids": []}

    async def stats(self) -> dict:
        return {"engines": {}, "router": {"num_blocks": 0, "num_snapshots": 0}}


@pytest.mark.parametrize("required", [False, True])
def test_the_page_needs_an_api_key_only_when_configured(required):
    """Prometheus scrapers carry no key: /metrics answers without one unless
    metrics_require_api_key (the API's routes need one whenever keys are set)."""
    from starlette.requests import Request

    from hybridserve.cluster.config import ServiceConfig
    from hybridserve.cluster.openai.protocol import OpenAIError
    from hybridserve.cluster.openai.routes import OpenAIServer

    config = ServiceConfig(api_keys=["k"], metrics_require_api_key=required)
    server = OpenAIServer(config, _Service())
    anonymous = Request({"type": "http", "method": "GET", "path": "/metrics", "headers": []})
    if required:
        with pytest.raises(OpenAIError, match="missing API key"):
            asyncio.run(server.scrape(anonymous))
    else:
        page = asyncio.run(server.scrape(anonymous))
        assert b"vllm:prompt_tokens_total" in page.body
    with pytest.raises(OpenAIError, match="missing API key"):
        asyncio.run(server.models(anonymous))


def test_refusals_are_counted_by_reason():
    metrics = ServiceMetrics("tiny", max_model_len=64)
    metrics.observe_refusal("overloaded")
    metrics.observe_refusal("overloaded")
    samples = scrape(metrics)
    refused = "hybridserve:requests_refused_total"
    assert samples[(refused, labels(reason="overloaded"))] == 2
    assert samples[(refused, labels(reason="no_engine"))] == 0


def test_an_engine_s_transfer_times_are_a_histogram():
    from hybridserve.cluster.metrics import HistogramCounts

    times = HistogramCounts()
    for seconds in (0.002, 0.003, 0.04, 100.0):
        times.observe(seconds)
    metrics = ServiceMetrics("tiny", max_model_len=64)
    metrics.update_engines({"prefill-0": {"transfer_time_seconds": times.model_dump()}})
    samples = scrape(metrics)
    engine = {"engine": "prefill-0"}
    bucket = "hybridserve:transfer_time_seconds_bucket"
    assert samples[(bucket, labels(le="0.001", **engine))] == 0
    assert samples[(bucket, labels(le="0.005", **engine))] == 2
    assert samples[(bucket, labels(le="0.05", **engine))] == 3
    assert samples[(bucket, labels(le="+Inf", **engine))] == 4
    assert samples[("hybridserve:transfer_time_seconds_count", labels(**engine))] == 4
    total = samples[("hybridserve:transfer_time_seconds_sum", labels(**engine))]
    assert total == pytest.approx(100.045)
