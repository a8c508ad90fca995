"""Admission and health over HTTP: a burst beyond what the engines run plus
`max_queued_requests` gets 429s (with Retry-After and an OpenAI error body) for the excess and
full answers for the rest, nothing lost and nothing held afterwards; a wedged engine turns
/health to 503 once it is overdue and leaves routing."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray

from tests.service import API_KEY, ENGINE, Service, assert_at_baseline, beside

pytestmark = pytest.mark.slow

STALL_TIMEOUT_S = 3.0
# 1 prefill + 1 decode engine running 8 sequences; 8 more may wait.
ADMISSION_SERVICE = {
    "num_prefill": 1,
    "num_decode": 1,
    "engine": ENGINE,
    "api_keys": [API_KEY],
    "torch_threads": 1,
    "max_queued_requests": 8,
    "engine_stall_timeout_s": STALL_TIMEOUT_S,
    "max_engine_restarts": 0,  # its last test takes the only decode engine out for good
}

# Long enough that a request holds its place for longer than the burst takes to arrive, on
# any machine: the excess must meet a full queue. (Eight running requests fit the pool:
# 8 x ~330 tokens of 192 blocks of 16; steps of up to eight rows are native, so tiny decodes
# several times faster than when this was 192.)
BURST_TOKENS = 320


@pytest.fixture(scope="module")
def admission_service(service: Service) -> Iterator[Service]:
    with beside(service, ADMISSION_SERVICE, "admission") as deployed:
        yield deployed


def test_a_burst_over_the_queue_limit_gets_200s_and_429s_and_nothing_else(admission_service):
    url = f"{admission_service.base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def one(i: int) -> httpx.Response:
        body = {
            "model": "tiny",
            "prompt": f"request {i} of the burst",
            "max_tokens": BURST_TOKENS,
            "ignore_eos": True,
        }
        return httpx.post(url, json=body, headers=headers, timeout=120)

    with ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(one, range(40)))
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses[200] >= 16  # 8 running + 8 queued at least; more as requests finish
    for response in responses:
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert response.json()["usage"]["completion_tokens"] == BURST_TOKENS
        else:
            error = response.json()["error"]
            assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
            assert "max_queued_requests=8" in error["message"]
            assert response.headers["Retry-After"] == "1"
    router = admission_service.topology()["router"]
    stats = ray.get(router.stats.remote())
    assert sum(stats["load"].values()) == 0 and stats["num_queued"] == 0
    # Every refusal is counted, by reason.
    page = httpx.get(f"{admission_service.base_url}/metrics").text
    refused = 'hybridserve:requests_refused_total{model_name="tiny",reason="overloaded"}'
    (line,) = [line for line in page.splitlines() if line.startswith(refused)]
    assert float(line.rsplit(" ", 1)[1]) == statuses[429]
    assert_at_baseline(admission_service)


def _wedge(actor: object, seconds: float) -> None:
    """Runs inside the engine actor: a thread takes the engine lock and keeps it, so the
    stepping loop stops coming round (as a step that never returns would)."""

    def hold() -> None:
        with actor.host.lock:
            time.sleep(seconds)

    threading.Thread(target=hold, daemon=True).start()


def test_zz_a_wedged_engine_turns_health_503_and_leaves_routing(admission_service):
    """Runs last: it takes the deployment's only decode engine out."""
    health = f"{admission_service.base_url}/health"
    assert httpx.get(health).status_code == 200
    decode = admission_service.engines()["decode-0"]
    ray.get(decode.__ray_call__.remote(_wedge, 60.0))
    wedged_at = time.monotonic()
    while httpx.get(health, timeout=30).status_code == 200:
        assert time.monotonic() - wedged_at < STALL_TIMEOUT_S + 5, "/health stayed 200"
        time.sleep(0.5)
    assert time.monotonic() - wedged_at >= STALL_TIMEOUT_S  # not before it is overdue
    assert "decode-0" not in admission_service.engines()  # out of routing
    response = httpx.post(
        f"{admission_service.base_url}/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_engine"
