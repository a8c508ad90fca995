"""The running service, driven over real HTTP with the official `openai` client.

One local Ray cluster with 1 prefill + 2 decode engines (tiny model) for the whole session.
Oracles: an offline colocated `LLM` for tokens; the engines' own integrity checks and free
counts for leaks. The engine-killing scenario runs last (this module's final test).
"""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import ray

from hybridserve.cluster.engine_host.cpu_binding import EnginePlacement, assign_cores
from hybridserve.cluster.openai.protocol import derive_cache_salt
from hybridserve.workers import LLM, SamplingParams
from tests.service import (
    API_KEY,
    ENGINE,
    OTHER_KEY,
    PROMPT,
    Service,
    assert_at_baseline,
    client,
    num_aborted,
    offline_tokens,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", **ENGINE)


def engine_stats(service: Service) -> dict[str, dict[str, Any]]:
    engines = service.engines()
    return dict(zip(engines, ray.get([h.stats.remote() for h in engines.values()]), strict=True))


def test_health_models_and_auth(service):
    assert httpx.get(f"{service.base_url}/health").status_code == 200
    models = client(service).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):
        client(service, "wrong-key").models.list()
    response = httpx.post(f"{service.base_url}/v1/completions", json={"prompt": "x"})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"


def test_completions_equal_an_offline_run(service, offline):
    greedy = client(service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    expected = offline_tokens(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    choice = greedy.choices[0]
    assert choice.token_ids == expected
    assert choice.text == offline.tokenizer.decode(expected)
    assert choice.finish_reason == "length"
    assert greedy.usage.completion_tokens == 12

    stream = client(service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        top_p=0.9,
        seed=11,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    streamed = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
    seeded = offline_tokens(
        offline, PROMPT, max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True
    )
    assert streamed == seeded
    assert_at_baseline(service)


def test_chat_streams_with_usage_and_equals_offline_chat(service, offline):
    messages = [{"role": "user", "content": "Say something about state space models."}]
    stream = client(service).chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (expected,) = offline.chat(messages, SamplingParams(max_tokens=9, temperature=0))
    assert text == expected.text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert_at_baseline(service)


def test_cached_tokens_are_reported_and_tenants_never_share(service, offline):
    base = [(7 * i + 3) % 250 for i in range(90)]
    follow_up = [*base, *range(40, 60)]
    params = {"max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    client(service).completions.create(model="tiny", prompt=base, **params)
    other = client(service, OTHER_KEY).completions.create(model="tiny", prompt=follow_up, **params)
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another tenant's prefix
    same = client(service).completions.create(model="tiny", prompt=follow_up, **params)
    assert same.usage.prompt_tokens_details.cached_tokens == len(base)
    expected = offline_tokens(offline, follow_up, max_tokens=4, temperature=0, ignore_eos=True)
    assert offline.tokenizer.decode(expected) == same.choices[0].text == other.choices[0].text
    assert_at_baseline(service)


def test_second_turn_resumes_on_the_decode_engine_that_served_the_first(service, offline):
    first_prompt = [(11 * i + 5) % 250 for i in range(120)]
    params = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    first = client(service).completions.create(
        model="tiny", prompt=first_prompt, max_tokens=16, **params
    )
    answer = first.choices[0].token_ids
    second_prompt = [*first_prompt, *answer, 1, 2, 3, 4, 5]
    holders = engine_stats(service)
    second = client(service).completions.create(
        model="tiny", prompt=second_prompt, max_tokens=6, **params
    )
    # The decode engine's turn-end snapshot: every token of turn 1 but the last sampled one.
    assert second.usage.prompt_tokens_details.cached_tokens == len(first_prompt) + 16 - 1
    after = engine_stats(service)
    hits = {n: after[n]["snapshot_hits"] - holders[n]["snapshot_hits"] for n in after}
    (holder,) = [n for n, h in hits.items() if h]
    assert holder.startswith("decode-")  # the suffix was short: prefilled there, no transfer
    assert second.choices[0].token_ids == offline_tokens(
        offline, second_prompt, max_tokens=6, temperature=0, ignore_eos=True
    )
    assert_at_baseline(service)


def test_chat_second_turn_reuses_at_least_the_first_turn(service):
    first_messages = [
        {"role": "system", "content": "You are a careful assistant. " * 4},
        {"role": "user", "content": "Tell me about Mamba layers."},
    ]
    chat = client(service).chat.completions.create
    first = chat(model="tiny", messages=first_messages, max_tokens=8, temperature=0)
    follow_up = [
        *first_messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And attention?"},
    ]
    second = chat(model="tiny", messages=follow_up, max_tokens=8, temperature=0)
    stable_len = LLM("tiny").tokenizer.render_chat(first_messages).stable_len
    assert stable_len is not None
    assert second.usage.prompt_tokens_details.cached_tokens >= stable_len
    # Reuse changes nothing in the answers: a run without it gives the same.
    no_reuse = LLM("tiny", **{**ENGINE, "enable_prefix_caching": False})
    greedy = SamplingParams(max_tokens=8, temperature=0)
    for messages, reply in ((first_messages, first), (follow_up, second)):
        (expected,) = no_reuse.chat(messages, greedy)
        assert reply.choices[0].message.content == expected.text
    assert_at_baseline(service)


def test_stop_strings_truncate_and_stop(service, offline):
    full = offline.tokenizer.decode(
        offline_tokens(offline, PROMPT, max_tokens=20, temperature=0, ignore_eos=True)
    )
    stop = full[8:11]
    cut = full[: full.index(stop)]
    result = client(service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (result.choices[0].text, result.choices[0].finish_reason) == (cut, "stop")
    assert_at_baseline(service)


def test_a_stream_interval_sends_fewer_chunks_of_the_same_text(colocated_service, offline):
    """The colocated service streams 3 tokens a chunk (tests/service.py): the first token at
    once, then one chunk per 3 (or fewer, larger ones: an ingress that falls behind joins
    what waits for it); the text is the offline run's, stop strings still cut it."""
    tokens = offline_tokens(offline, PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    full = offline.tokenizer.decode(tokens)
    params = {
        "model": "tiny",
        "prompt": PROMPT,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    chunks = list(
        client(colocated_service).completions.create(**params, max_tokens=10, stream=True)
    )
    assert len(chunks) <= 4  # 10 tokens: the first, then 3, 3, 3
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert "".join(c.choices[0].text for c in chunks) == full
    stop = full[8:11]
    stopped = client(colocated_service).completions.create(
        **params, max_tokens=10, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in stopped) == full[: full.index(stop)]
    assert_at_baseline(colocated_service)


BAD_REQUESTS = [
    ("not json", 400, "not valid JSON"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 129}, 400, "n"),
    # Hostile bodies: each is refused before it reaches an engine.
    ('{"prompt": ' + "[" * 20000 + "]" * 20000 + "}", 400, "nested deeper than 64"),
    ('{"prompt": "x", "temperature": Infinity}', 400, "Infinity is not a JSON value"),
    ('{"prompt": "x", "top_p": NaN}', 400, "NaN is not a JSON value"),
    ('{"prompt": "a\\ud800b"}', 400, "lone UTF-16 surrogate"),
    ('{"prompt": "x", "cache_salt": "\\udc00"}', 400, "cache_salt: the string holds a lone"),
    ({"prompt": "x", "stop_token_ids": [99999]}, 400, "99999"),
    ({"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias key '99999'"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, 400, "[-100, 100]"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of"),
    (
        {
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "nonsense"}},
            },
        },
        400,
        "response_format",
    ),
    ({"prompt": [1, 2, 99999]}, 400, "99999"),
    ({"prompt": "x" * 800, "max_tokens": 10}, 400, "maximum context length is 768"),
    ({"prompt": "x", "stop_token_ids": [-1]}, 400, "-1"),
    ({"prompt": 12}, 400, "prompt"),
]


@pytest.mark.parametrize(("body", "status", "needle"), BAD_REQUESTS)
def test_bad_requests_get_an_openai_error_and_the_service_keeps_serving(
    service, body, status, needle
):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{service.base_url}/v1/completions"
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers=headers)
    else:
        response = httpx.post(url, json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    ok = client(service).completions.create(model="tiny", prompt="ok", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert_at_baseline(service)


def test_an_oversized_body_is_413(service):
    response = httpx.post(
        f"{service.base_url}/v1/completions",
        content=b'{"prompt": "' + b"x" * (9 << 20) + b'"}',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert response.status_code == 413


def test_a_client_disconnect_aborts_the_request_everywhere(service):
    """The request is aborted on the engine running it, not left to finish its 600 tokens
    (which would also leave the pools at baseline once done)."""
    before = num_aborted(service)
    with httpx.stream(
        "POST",
        f"{service.base_url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 600, "ignore_eos": True, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in received)
    assert_at_baseline(service)  # nothing left running or held on any engine
    assert num_aborted(service) > before


def test_metrics_expose_request_and_hybrid_counters(service):
    """Scraped as Prometheus does, without an API key (the service has keys: /metrics needs
    none unless metrics_require_api_key)."""
    response = httpx.get(f"{service.base_url}/metrics")
    assert response.status_code == 200
    text = response.text
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "hybridserve:snapshot_hits_total",
        "hybridserve:transfer_bytes_total",
        "hybridserve:prefix_index_blocks",
    ):
        assert name in text, name
    # The leak detectors, per engine: 0 with nothing running.
    for name in ("kv_blocks_in_use", "state_slots_in_use", "transfers_in_flight", "handoffs_held"):
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(f"hybridserve:{name}{{")
        ]
        assert values == [0.0] * 3, (name, values)
    assert httpx.get(f"{service.base_url}/v1/models").status_code == 401  # the API still is


# The series vLLM's Grafana dashboard queries (examples/observability/prometheus_grafana/
# grafana.json in vLLM's repository), as data: dashboards, KEDA rules and llm-d's scorers
# written for vLLM read these names.
VLLM_DASHBOARD = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]


def series(text: str, name: str) -> list[float]:
    """The values of every series of `name` on a scraped page."""
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]


def test_vllm_s_grafana_dashboard_finds_every_series_it_queries(service):
    before = httpx.get(f"{service.base_url}/metrics").text
    client(service).completions.create(model="tiny", prompt=PROMPT * 4, max_tokens=4)
    text = httpx.get(f"{service.base_url}/metrics").text
    for name in VLLM_DASHBOARD:
        assert series(text, name), name
    # The request counted in each latency histogram; its prompt crossed to a decode engine.
    for name in (
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "hybridserve:transfer_time_seconds_count",
    ):
        assert sum(series(text, name)) > sum(series(before, name)), name
    assert series(text, "hybridserve:requests_refused_total")  # at 0 until one is refused


def test_clearing_the_caches_empties_the_prefix_index_at_once(service):
    client(service).completions.create(model="tiny", prompt=PROMPT * 2, max_tokens=2)
    router = service.topology()["router"]
    assert ray.get(router.stats.remote())["num_blocks"] > 0
    service.coordinator.clear_caches.remote().result()
    stats = ray.get(router.stats.remote())
    assert (stats["num_blocks"], stats["num_snapshots"]) == (0, 0)
    assert_at_baseline(service)


def test_cpu_engines_run_on_cores_of_their_own_where_they_fit(service, colocated_service):
    """cpu_binding "auto": each service's CPU engines get the cores `assign_cores` gives them
    from what they reported when placed (the 1 prefill + 2 decode engines need three free
    cores; the colocated one, placed after them, one), and a bound engine's stepping thread
    runs on those cores only, while its event loop still runs anywhere; no core is bound
    twice."""
    held: list[int] = []
    for deployed in (service, colocated_service):
        binding = deployed.coordinator.cpu_binding.remote().result()
        placed = [
            EnginePlacement(**{**p, "cores": tuple(p["cores"])})
            for p in deployed.coordinator.cpu_placements.remote().result()
        ]
        engines = deployed.engines()
        assert set(binding) == {p.name for p in placed} == set(engines)
        expected = assign_cores(placed)
        assert {n: None if c is None else list(c) for n, c in expected.items()} == binding
        reports = ray.get([engines[name].cpu_placement.remote() for name in binding])
        for bound, report in zip(binding.values(), reports, strict=True):
            if bound is not None:
                assert report["team_cores"] == bound
                assert set(bound) <= set(report["cpu_cores"])  # its own claim is not "held"
                held += bound
    assert len(held) == len(set(held))
    colocated = placed[0]
    if colocated.bindable and colocated.cores:  # a core was free: it must have been bound
        assert binding[colocated.name] == [colocated.cores[0]]


def test_zz_a_decode_engine_killed_mid_stream_ends_in_an_error_event(service):
    """Runs after the rest: the killed engine is gone until the Coordinator restarts it."""
    stream = client(service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=700,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    running = {n: s for n, s in engine_stats(service).items() if s["num_requests_running"]}
    (victim,) = [n for n in running if n.startswith("decode-")]
    ray.kill(service.engines()[victim])
    with pytest.raises(openai.APIError, match="died"):
        for _ in chunks:
            pass
    survivor = client(service).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert survivor.choices[0].finish_reason == "length"
    assert victim not in service.engines()
    router = service.topology()["router"]
    assert victim not in ray.get(router.stats.remote())["engines"]
    assert victim not in ray.get(router.score.remote(list(range(40)), None))
    assert_at_baseline(service)


def test_zzz_the_killed_engine_is_restarted_and_serves_again(service):
    """After the previous test: the Coordinator restarts the killed decode engine (a new
    incarnation under its name, with an empty index) and routes to it again."""
    deadline = time.monotonic() + 120
    while "decode-1" not in service.engines() or "decode-0" not in service.engines():
        assert time.monotonic() < deadline, "the killed engine did not come back"
        time.sleep(0.5)
    topology = service.topology()
    assert sorted(topology["incarnations"].values()) == [0, 0, 1]  # one restarted
    (restarted,) = [n for n, i in topology["incarnations"].items() if i == 1]
    # Stale reports: about its earlier incarnation, or about an engine an earlier
    # Coordinator started (whose incarnations counted from 0 as well).
    service.coordinator.mark_dead.remote(restarted, 0).result()
    service.coordinator.mark_dead.remote(restarted, 1, "an-earlier-coordinator").result()
    assert service.topology()["incarnations"][restarted] == 1
    router = topology["router"]
    prompts = [[7 + i, *range(60, 100)] for i in range(4)]  # fresh: no engine holds them
    for prompt in prompts:  # no reuse anywhere: ties go round both decode engines
        result = client(service).completions.create(
            model="tiny", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].finish_reason == "length"
    salt = derive_cache_salt("tenant-a", None)  # the tenant of API_KEY
    scores = [ray.get(router.score.remote(p, salt)) for p in prompts]
    served = [s[restarted]["attention_tokens"] for s in scores]
    assert any(served), scores  # its cache events reach the index: it holds a prompt
    assert_at_baseline(service)


def test_the_serving_address_is_the_running_proxy_s(service):
    """A launch on a cluster where Serve already runs is served at that proxy's address, not
    at the port it asked for (Serve ignores a second start's http_options)."""
    from hybridserve.cluster.control import local

    url = urlsplit(service.base_url)
    assert local.serving_address() == (url.hostname, url.port)


def test_the_ingress_replica_also_takes_requests_directly(service, colocated_service, offline):
    """Serve's direct ingress (on for a cluster we start, cluster/control/local.py): the ingress
    replica's own address answers as the proxy does, for the application at the root and for
    one under a route prefix."""
    from hybridserve.cluster.control import local

    prompt = [5, 9, 11, 4]
    expected = offline_tokens(offline, prompt, max_tokens=6, temperature=0.0)
    for deployed, name in ((service, local.APP_NAME), (colocated_service, "hybridserve-colocated")):
        direct = local.direct_url(name)
        assert direct is not None and urlsplit(direct).port != urlsplit(deployed.base_url).port
        assert urlsplit(direct).path == urlsplit(deployed.base_url).path
        served = client(Service(direct, deployed.coordinator)).completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert served.choices[0].model_extra["token_ids"] == expected
        assert_at_baseline(deployed)
