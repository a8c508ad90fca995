"""A bounded soak of the 1 prefill + 2 decode service: mixed completions and chats, streamed
and not, shared prefixes and cache salts, clients that go away at every phase, bad requests
and bursts over the queue limit, from several client threads at once.

At the end every request has ended exactly once (its answer, a 4xx it deserved, or our own
disconnect; never a 5xx), a fixed probe still gives the offline engine's tokens, every engine's
pools and in-use metrics are at baseline, and the engines' RSS growth is bounded. The figures
(requests by outcome, TTFT p50/p99, RSS) are printed, and written as JSON to
$HYBRIDSERVE_SOAK_REPORT if set. HYBRIDSERVE_SOAK_SECONDS sets the length (default 60).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from hybridserve.workers import LLM
from tests.service import (
    API_KEY,
    ENGINE,
    OTHER_KEY,
    PROMPT,
    SERVICE,
    Service,
    assert_at_baseline,
    client,
    offline_tokens,
)

pytestmark = pytest.mark.slow

SECONDS = float(os.environ.get("HYBRIDSERVE_SOAK_SECONDS", "60"))
NUM_CLIENTS = 6
PREFIXES = [PROMPT, "A shared system prompt about hybrid models. " * 3, "Tell me a story. "]
BAD_BODIES = [
    b"not json",
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "max_tokens": -1}',
    b'{"prompt": [1, 2, 99999]}',
    b'{"prompt": "x", "suffix": "y"}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
]
MAX_RSS_GROWTH_MIB = 256


def _rss_mib(actor: Any) -> float:
    """Runs inside an engine actor: its resident set size."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def engine_rss(service: Service) -> dict[str, float]:
    engines = service.engines()
    sizes = ray.get([h.__ray_call__.remote(_rss_mib) for h in engines.values()])
    return dict(zip(engines, sizes, strict=True))


class Soak:
    def __init__(self, service: Service, seed: int) -> None:
        self.service = service
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.ttfts: list[float] = []
        self.unexpected: list[str] = []
        self.lock = threading.Lock()
        base = service.base_url
        self.urls = {"completions": f"{base}/v1/completions", "chat": f"{base}/v1/chat/completions"}

    def record(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if outcome == "unexpected":
                self.unexpected.append(detail)

    def headers(self, rng: random.Random) -> dict[str, str]:
        return {"Authorization": f"Bearer {rng.choice([API_KEY, API_KEY, OTHER_KEY])}"}

    def body(self, rng: random.Random, *, stream: bool) -> tuple[str, dict[str, Any]]:
        text = rng.choice(PREFIXES) + f" #{rng.randrange(10_000)}"
        common: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": rng.randint(1, 24),
            "temperature": rng.choice([0.0, 0.8]),
            "stream": stream,
        }
        if rng.random() < 0.3:
            common["cache_salt"] = rng.choice(["salt-a", "salt-b"])
        if stream:
            common["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            return "chat", common | {"messages": [{"role": "user", "content": text}]}
        return "completions", common | {"prompt": text}

    def judge(self, response: httpx.Response, text: str) -> None:
        """A finished exchange: an answer, a deserved refusal, or a bug."""
        status = response.status_code
        if status == 429:
            self.record("refused_429")
        elif status == 400:
            self.record("bad_request_400")
        elif status != 200:
            self.record("unexpected", f"{status}: {text[:200]}")
        elif response.headers.get("content-type", "").startswith("text/event-stream"):
            ok = text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            self.record("completed_stream" if ok else "unexpected", text[-300:])
        else:
            ok = json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
            self.record("completed" if ok else "unexpected", text[:300])

    def one(self, rng: random.Random) -> None:
        kind = rng.random()
        headers = self.headers(rng)
        if kind < 0.08:
            response = httpx.post(
                self.urls["completions"],
                content=rng.choice(BAD_BODIES),
                headers=headers | {"Content-Type": "application/json"},
                timeout=60,
            )
            self.judge(response, response.text)
            return
        stream = kind < 0.6
        route, body = self.body(rng, stream=stream)
        disconnect = rng.random() < 0.25
        if not stream:
            try:
                # A client that gives up during prefill or decode: a tiny read timeout.
                timeout = httpx.Timeout(60, read=rng.uniform(0.005, 0.05)) if disconnect else 60
                response = httpx.post(self.urls[route], json=body, headers=headers, timeout=timeout)
            except httpx.ReadTimeout:
                self.record("disconnected")
                return
            self.judge(response, response.text)
            return
        start = time.monotonic()
        with httpx.stream("POST", self.urls[route], json=body, headers=headers, timeout=60) as r:
            if r.status_code != 200:
                self.judge(r, r.read().decode())
                return
            lines, first = [], None
            cut = rng.randint(0, 3) if disconnect else None
            for line in r.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - start
                lines.append(line)
                if cut is not None and len(lines) > cut:
                    self.record("disconnected")
                    return
            if first is not None:
                with self.lock:
                    self.ttfts.append(first)
            self.judge(r, "\n".join(lines))

    def burst(self, size: int) -> None:
        """Many requests at once, beyond what runs plus what may queue."""
        rng = random.Random(self.rng.random())

        def send(_: int) -> None:
            route, body = self.body(random.Random(rng.random()), stream=False)
            body["max_tokens"] = 24
            try:
                response = httpx.post(
                    self.urls[route], json=body, headers=self.headers(rng), timeout=120
                )
                self.judge(response, response.text)
            except Exception as exc:
                self.record("unexpected", repr(exc))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def client_loop(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            try:
                self.one(rng)
            except Exception as exc:  # an exchange that broke in a way we did not expect
                self.record("unexpected", repr(exc))


def actors_named_in(service: Service, errors: list[str]) -> dict[str, str]:
    """Which of the service's actors the error messages name (which one stalled, failed...)."""
    topology = service.topology()
    handles = {"router": topology["router"], **topology["engines"]}
    ids = {handle._actor_id.hex(): name for name, handle in handles.items()}
    named = set(re.findall(r"actor ([0-9a-f]{32})", " ".join(errors)))
    return {actor: ids.get(actor, "another actor") for actor in named}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def test_soak(service):
    offline = LLM("tiny", **ENGINE)
    rss_start = engine_rss(service)
    soak = Soak(service, seed=1)
    deadline = time.monotonic() + SECONDS
    threads = [
        threading.Thread(target=soak.client_loop, args=(i, deadline)) for i in range(NUM_CLIENTS)
    ]
    for thread in threads:
        thread.start()
    # Bursts over the queue limit (16 run + 16 may queue), twice during the run.
    running = 2 * SERVICE["engine"]["max_num_seqs"]
    for _ in range(2):
        time.sleep(SECONDS / 3)
        soak.burst(running + SERVICE["max_queued_requests"] + 16)
    for thread in threads:
        thread.join()

    assert_at_baseline(service)  # pools free, in-use metrics 0, no integrity failure
    probe = client(service).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = offline_tokens(offline, PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert probe.choices[0].text == offline.tokenizer.decode(expected)
    rss_end = engine_rss(service)
    report = {
        "seconds": SECONDS,
        "requests_by_outcome": dict(soak.outcomes),
        "ttft_p50_s": percentile(soak.ttfts, 0.5),
        "ttft_p99_s": percentile(soak.ttfts, 0.99),
        "rss_start_mib": rss_start,
        "rss_end_mib": rss_end,
    }
    print(json.dumps(report, indent=2))
    if os.environ.get("HYBRIDSERVE_SOAK_REPORT"):
        Path(os.environ["HYBRIDSERVE_SOAK_REPORT"]).write_text(json.dumps(report, indent=2))
    assert not soak.unexpected, (
        actors_named_in(service, soak.unexpected),
        soak.unexpected[:3],
    )
    for outcome in ("completed", "completed_stream", "disconnected", "bad_request_400"):
        assert soak.outcomes[outcome] > 0, (outcome, soak.outcomes)
    assert soak.outcomes["refused_429"] > 0, soak.outcomes  # the bursts went over the limit
    growth = {name: rss_end[name] - rss_start[name] for name in rss_end}
    assert max(growth.values()) < MAX_RSS_GROWTH_MIB, growth
