"""Fault-matrix scenarios over real HTTP: client disconnects at each phase of a P/D request
(11), an abort and an engine error mid-stream on the raw SSE bytes (28), a cancel storm (29),
a stale prefix index (19), the prefill engine killed mid-hand-off (8), and a graceful shutdown
with requests in flight (31).

Faults are injected inside the engine actors (`__ray_call__`): a prefill engine that stops
stepping after its first chunk, decode receivers that hold an incoming transfer, a step that
raises, an eviction whose removal events are held back. Oracles: the offline `LLM`'s tokens,
the raw SSE bytes, and the service at baseline afterwards (pools free, in-use metrics 0, the
router's admission load 0 and no request stream left open on any engine). The tests that
kill or shut down engines run on a 1 prefill + 1 decode deployment of their own, the last
two tests of this module.
"""

from __future__ import annotations

import json
import random
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import ray
from ray import serve

from hybridserve.cluster.openai_protocol import derive_cache_salt
from hybridserve.workers import LLM
from tests.service import (
    API_KEY,
    ENGINE,
    PROMPT,
    Service,
    assert_at_baseline,
    beside,
    client,
    offline_tokens,
)

pytestmark = pytest.mark.slow

# The functions below that run inside engine actors travel by value: importing this module
# there (and the client libraries it imports) would cost each engine process seconds.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0, "ignore_eos": True}
PROBE_TOKENS = 8
DRAIN_TIMEOUT_S = 2.0
# 1 prefill + 1 decode engine; long outputs, so a shutdown finds requests that cannot finish.
FAULTS_SERVICE = {
    "num_prefill": 1,
    "num_decode": 1,
    "engine": ENGINE | {"max_model_len": 4096, "num_kv_blocks": 1024},
    "api_keys": [API_KEY],
    "torch_threads": 1,
    "transfer_timeout_s": 10.0,
    "drain_timeout_s": DRAIN_TIMEOUT_S,
    "max_engine_restarts": 0,  # the prefill engine killed in scenario 8 stays down
}


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM("tiny", **ENGINE)


@pytest.fixture(scope="module")
def probe_tokens(offline: LLM) -> list[int]:
    return offline_tokens(offline, PROMPT, max_tokens=PROBE_TOKENS, **GREEDY)


@pytest.fixture(scope="module")
def faults(service: Service) -> Iterator[Service]:
    """1 prefill + 1 decode engine under /faults; its last test deletes it."""
    with beside(service, FAULTS_SERVICE, "faults") as deployed:
        yield deployed


# ---- faults injected inside an engine actor (run there through __ray_call__) --------------


def _hold_steps(actor: Any, allowed: int) -> None:
    """The engine runs `allowed` more steps with work, then stalls (its loop keeps beating,
    but no request advances) until `_resume_steps`."""
    engine = actor.worker.engine
    real = type(engine).step
    budget = [allowed]

    def step() -> list[Any]:
        if not engine.scheduler.has_unfinished():
            return real(engine)
        if budget[0] > 0:
            budget[0] -= 1
            return real(engine)
        # Stalled: idle a moment without the engine lock (the stepping loop holds it here),
        # so that calls into the engine (stats, abort) are not starved.
        actor.worker.lock.release()
        try:
            time.sleep(0.01)
        finally:
            actor.worker.lock.acquire()
        return []

    engine.step = step


def _resume_steps(actor: Any) -> None:
    vars(actor.worker.engine).pop("step", None)


def _hold_receives(actor: Any) -> None:
    """Incoming transfers wait (after their request arrived, before anything is reserved)
    until `_resume_receives`; `_receives_done` counts those handled since."""
    receiver = actor.worker.links.receiver
    gate = actor.receive_gate = threading.Event()
    actor.receives_done = 0
    real = type(receiver)._receive

    def receive(*args: Any) -> None:
        gate.wait()
        try:
            real(receiver, *args)
        finally:
            actor.receives_done += 1

    receiver._receive = receive


def _resume_receives(actor: Any) -> None:
    vars(actor.worker.links.receiver).pop("_receive", None)
    actor.receive_gate.set()


def _receives_done(actor: Any) -> int:
    """Transfers the held receiver has handled (landed, failed or refused) since held."""
    return actor.receives_done


def _fail_next_step(actor: Any) -> None:
    """The engine's next step raises (then stepping is back to normal)."""
    engine = actor.worker.engine

    def step() -> list[Any]:
        del engine.step
        raise RuntimeError("injected: this step fails")

    engine.step = step


def _evict_unannounced(actor: Any) -> int:
    """Drop every cached block and snapshot, and hold back the removal events: the prefix
    index keeps saying warm until `_announce_held_events`."""
    worker = actor.worker
    with worker._flush_lock, worker.lock:
        worker.engine.clear_cache()
        actor.held_events, worker._pending_events = worker._pending_events, []
    return len(actor.held_events)


def _announce_held_events(actor: Any) -> None:
    """Send the removal events `_evict_unannounced` held back (ahead of any newer ones)."""
    worker = actor.worker
    with worker._flush_lock, worker.lock:
        worker._pending_events[:0] = actor.held_events
        actor.held_events = []
    worker._flush_cache_events()


def _num_streams(actor: Any) -> int:
    """Request streams open on the engine (each is a request some caller still follows)."""
    return len(actor.worker._streams)


@contextmanager
def injected(
    handles: list[Any], fault: Callable[..., Any], undo: Callable[[Any], Any], *args: Any
) -> Iterator[None]:
    """`fault` in each engine actor for the block; undone whatever happens."""
    ray.get([h.__ray_call__.remote(fault, *args) for h in handles])
    try:
        yield
    finally:
        ray.get([h.__ray_call__.remote(undo) for h in handles])


# ---- helpers ----------------------------------------------------------------------------


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `predicate` until it is true; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.02)
    return value


def stats(handle: Any) -> dict[str, Any]:
    """An engine's load, cache and leak figures (what /metrics exports)."""
    return ray.get(handle.stats.remote())


def fresh_prompt(seed: int, length: int) -> list[int]:
    """Token ids no earlier request shares a block with (the seed picks them)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(length)]


def assert_nothing_held(service: Service) -> None:
    """`assert_at_baseline`, and what the service keeps per request outside the pools is
    gone too: the router's load (admission slots) is 0 and no engine has a stream open."""
    assert_at_baseline(service)
    router = service.topology()["router"]
    engines = service.engines()

    def held() -> tuple[dict[str, int], dict[str, int]]:
        load = ray.get(router.stats.remote())["load"]
        streams = ray.get([h.__ray_call__.remote(_num_streams) for h in engines.values()])
        return (
            {name: n for name, n in load.items() if n},
            {name: n for name, n in zip(engines, streams, strict=True) if n},
        )

    deadline = time.monotonic() + 10
    while any(state := held()):
        assert time.monotonic() < deadline, f"held (router load, open streams): {state}"
        time.sleep(0.05)


def assert_probe_served(service: Service, expected: list[int]) -> None:
    """A greedy probe request gets the offline engine's tokens."""
    reply = client(service).completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=PROBE_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert reply.choices[0].token_ids == expected


def open_request(service: Service, body: dict[str, Any]) -> socket.socket:
    """A streamed completion over a plain socket, which the test closes when it chooses."""
    url = urlsplit(service.base_url)
    payload = json.dumps({"model": "tiny", "stream": True, **body}).encode()
    head = (
        f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall(head.encode() + payload)
    return sock


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` events of an SSE body: parsed JSON, or the string "[DONE]"."""
    events: list[Any] = []
    for frame in raw.decode().split("\n\n"):
        if frame.strip():
            assert frame.startswith("data: "), frame
            data = frame.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_token_ids(events: list[Any]) -> list[int]:
    return [
        t
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
        for t in c.get("token_ids") or []
    ]


def assert_ends_in_one_error(raw: bytes, needle: str) -> list[Any]:
    """Exactly one error event, last, naming `needle`; no [DONE]; no chunk claims the
    request finished normally (`stop` / `length`). Returns the events."""
    assert b"data: [DONE]" not in raw
    events = sse_events(raw)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] is errors[0], events[-3:]
    assert needle in errors[0]["error"]["message"], errors[0]
    reasons = {c.get("finish_reason") for e in events[:-1] for c in e["choices"]}
    assert not reasons & {"stop", "length"}, reasons
    return events


def stream_raw(
    service: Service, body: dict[str, Any], after_first: Callable[[dict[str, Any]], None]
) -> bytes:
    """A streamed completion's raw body; `after_first` runs once the first chunk is in."""
    raw = b""
    with httpx.stream(
        "POST",
        f"{service.base_url}/v1/completions",
        json={"model": "tiny", "stream": True, "return_token_ids": True, **body},
        headers=HEADERS,
        timeout=60,
    ) as response:
        assert response.status_code == 200
        called = False
        for chunk in response.iter_raw():
            raw += chunk
            if not called and b"\n\n" in raw:
                called = True
                after_first(sse_events(raw.split(b"\n\n")[0] + b"\n\n")[0])
    return raw


def decode_engines(service: Service) -> dict[str, Any]:
    return {n: h for n, h in service.engines().items() if n.startswith("decode-")}


# ---- scenario 11: a client disconnect at each phase of a P/D request ---------------------
# test_service.py::test_a_client_disconnect_aborts_the_request_everywhere covers a disconnect
# a few tokens into decoding; these cover the phases before it.


def test_a_disconnect_during_prefill_aborts_it_there(service, probe_tokens):
    """A client that leaves while its long prompt is half prefilled (the prefill engine holds
    its blocks and Mamba slot, no token yet): the prefill engine drops it right there,
    nothing reaches a decode engine, and the service is at baseline and answers
    correctly afterwards."""
    prefill = service.engines()["prefill-0"]
    before = stats(prefill)
    prompt = fresh_prompt(1101, 700)  # two prefill chunks: 512 (a snapshot point) + 188
    with injected([prefill], _hold_steps, _resume_steps, 1):
        sock = open_request(service, {"prompt": prompt, "max_tokens": 40, "ignore_eos": True})
        wait_for(
            lambda: stats(prefill)["kv_blocks_in_use"] >= 512 // ENGINE["block_size"],
            "the first prefill chunk",
        )
        sock.close()
        # Steps are still held: the request can only leave by being aborted.
        wait_for(lambda: stats(prefill)["kv_blocks_in_use"] == 0, "the abort on prefill")
    after = stats(prefill)
    assert after["transfer_bytes"] == before["transfer_bytes"]  # never handed off
    assert after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"] == 512
    assert_nothing_held(service)
    assert_probe_served(service, probe_tokens)


def test_a_disconnect_during_the_hand_off_stops_the_request_everywhere(service, probe_tokens):
    """A client that leaves while its request is handed off (prefill done, the transfer to
    the decode engine in flight, no token sent to the client yet): once the transfer
    resolves, no decode engine goes on with the request (it does not recompute or decode
    700 tokens for nobody), and everything is at baseline."""
    prefill = service.engines()["prefill-0"]
    decodes = list(decode_engines(service).values())
    prompt = fresh_prompt(1102, 20)
    engines = list(service.engines().values())
    with injected(decodes, _hold_receives, _resume_receives):
        sock = open_request(service, {"prompt": prompt, "max_tokens": 700, "ignore_eos": True})
        wait_for(lambda: stats(prefill)["transfers_in_flight"] == 1, "the hand-off")
        sock.close()
        # The abort has reached both sides before the transfer goes on: the prefill engine
        # (its call cancelled) and the decode engine that expected the request.
        wait_for(
            lambda: not any(ray.get([h.__ray_call__.remote(_num_streams) for h in engines])),
            "every engine to drop the request's stream",
        )
    wait_for(
        lambda: sum(ray.get([h.__ray_call__.remote(_receives_done) for h in decodes])) == 1,
        "the decode side to settle the transfer",
    )

    def idle() -> bool:
        return not any(r["busy"] for r in ray.get([h.check_integrity.remote() for h in decodes]))

    # Decoding 700 tokens takes several seconds; a request stopped at once is gone in far less.
    wait_for(idle, "the decode engines to drop the request", timeout=3.0)
    assert_nothing_held(service)
    assert_probe_served(service, probe_tokens)


def test_a_disconnect_right_after_the_first_token_aborts_the_request_everywhere(
    service, probe_tokens
):
    """A client that leaves as soon as its first token has arrived (the prefill engine's,
    delivered once the decode engine has taken the request over): the request stops on
    every engine, nothing is held, and the service answers correctly afterwards."""
    with httpx.stream(
        "POST",
        f"{service.base_url}/v1/completions",
        json={"prompt": fresh_prompt(1103, 30), "max_tokens": 700, "stream": True, **GREEDY},
        headers=HEADERS,
        timeout=60,
    ) as response:
        first = next(line for line in response.iter_lines() if line)
    assert first.startswith("data: {")
    assert_nothing_held(service)
    assert_probe_served(service, probe_tokens)


# ---- scenario 28: streaming semantics when a request ends badly mid-stream ----------------


def test_an_engine_abort_mid_stream_ends_in_one_error_event(service, offline, probe_tokens):
    """A request aborted by its decode engine mid-stream: the tokens streamed so far are
    the offline engine's, then exactly one error event, no [DONE], no normal finish."""
    prompt = fresh_prompt(2801, 24)

    def abort(first: dict[str, Any]) -> None:
        aborted = ray.get([h.abort.remote(first["id"]) for h in decode_engines(service).values()])
        assert sorted(aborted) == [False, True]  # known on exactly one engine

    raw = stream_raw(service, {"prompt": prompt, "max_tokens": 700, **GREEDY}, abort)
    events = assert_ends_in_one_error(raw, "aborted")
    tokens = streamed_token_ids(events)
    assert tokens and tokens == offline_tokens(offline, prompt, max_tokens=len(tokens), **GREEDY)
    assert_nothing_held(service)
    assert_probe_served(service, probe_tokens)


def test_an_engine_error_mid_stream_ends_in_one_error_event(service, offline, probe_tokens):
    """A decode engine whose step fails mid-stream: exactly one error event naming the
    failure, no [DONE], no normal finish; the engine keeps serving."""
    prompt = fresh_prompt(2802, 24)

    def fail(first: dict[str, Any]) -> None:
        (running,) = [
            h for h in decode_engines(service).values() if stats(h)["num_requests_running"]
        ]
        ray.get(running.__ray_call__.remote(_fail_next_step))

    raw = stream_raw(service, {"prompt": prompt, "max_tokens": 700, **GREEDY}, fail)
    events = assert_ends_in_one_error(raw, "the engine step failed")
    tokens = streamed_token_ids(events)
    assert tokens and tokens == offline_tokens(offline, prompt, max_tokens=len(tokens), **GREEDY)
    assert_nothing_held(service)
    assert_probe_served(service, probe_tokens)


# ---- scenario 29: a cancel storm --------------------------------------------------------

STORM_SIZE = 32  # 2 decode engines x 8 sequences run, 16 more may queue: all are admitted
STORM_ROUNDS = 4
STORM_WAIT_S = 1.0


def test_a_cancel_storm_leaves_nothing_behind(service, probe_tokens):
    """Rounds of 32 concurrent streamed P/D requests (every one admitted, none refused: the
    decode engines' 16 slots plus 16 queued), all cancelled by their clients once each has
    its first token or 1 s has passed: after each round the pools, the in-use metrics and
    the router's admission load are at baseline, no engine holds a request stream, and a
    probe gets the offline tokens."""
    router = service.topology()["router"]
    for round_ in range(STORM_ROUNDS):
        socks = [
            open_request(
                service,
                {
                    "prompt": fresh_prompt(29_000 + 100 * round_ + i, 24),
                    "max_tokens": 200,
                    "ignore_eos": True,
                },
            )
            for i in range(STORM_SIZE)
        ]
        received = dict.fromkeys(socks, b"")
        admitted = 0  # the most requests the router counted on the decode engines at once
        with selectors.DefaultSelector() as selector:
            for sock in socks:
                selector.register(sock, selectors.EVENT_READ)
            started = time.monotonic()
            while admitted < STORM_SIZE or (
                time.monotonic() - started < STORM_WAIT_S
                and not all(b"data: {" in r for r in received.values())
            ):
                assert time.monotonic() - started < 30, f"{admitted} of {STORM_SIZE} admitted"
                for key, _ in selector.select(timeout=0.05):
                    chunk = key.fileobj.recv(1 << 16)
                    received[key.fileobj] += chunk
                    if not chunk:
                        selector.unregister(key.fileobj)
                refused = [r[:80] for r in received.values() if len(r) >= 12 and r[9:12] != b"200"]
                assert not refused, refused
                load = ray.get(router.stats.remote())["load"]
                admitted = max(admitted, sum(n for e, n in load.items() if e.startswith("decode-")))
        for sock in socks:
            sock.close()
        assert_nothing_held(service)
        assert_probe_served(service, probe_tokens)


# ---- scenario 19: the prefix index says warm, the engine has evicted ----------------------
# The other half (a dead engine's index entries go with it) is asserted by
# test_service.py::test_zz_a_decode_engine_killed_mid_stream_ends_in_an_error_event (decode)
# and by test_the_prefill_engine_killed_mid_hand_off_leaves_decode_serving below (prefill).


def test_a_stale_prefix_index_costs_reuse_never_correctness(service, offline):
    """The index says a decode engine holds a conversation's first turn; the engine has
    evicted it, its removal events not yet applied. The second turn is routed there on the
    index's word (the holder prefills it itself), the engine computes the whole prompt, and
    the answer is the offline engine's, reporting no cached tokens."""
    first_prompt = fresh_prompt(1901, 100)
    params = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    first = client(service).completions.create(
        model="tiny", prompt=first_prompt, max_tokens=16, **params
    )
    second_prompt = [*first_prompt, *first.choices[0].token_ids, 1, 2, 3, 4, 5]
    router = service.topology()["router"]
    salt = derive_cache_salt("tenant-a", None)  # API_KEY's tenant
    decodes = decode_engines(service)

    def holder() -> str | None:
        scores = ray.get(router.score.remote(second_prompt, salt))
        warm = [n for n in decodes if scores[n]["snapshot_tokens"] == len(first_prompt) + 15]
        return warm[0] if warm else None

    name = wait_for(holder, "the first turn's turn-end snapshot in the index")
    engine = decodes[name]
    try:
        assert ray.get(engine.__ray_call__.remote(_evict_unannounced)) > 0
        assert holder() == name  # stale: the index still says warm
        before = {n: stats(h)["num_prompt_tokens_computed"] for n, h in service.engines().items()}
        second = client(service).completions.create(
            model="tiny", prompt=second_prompt, max_tokens=6, **params
        )
        after = {n: stats(h)["num_prompt_tokens_computed"] for n, h in service.engines().items()}
    finally:
        ray.get(engine.__ray_call__.remote(_announce_held_events))
    computed = {n: after[n] - before[n] for n in after}
    assert computed == {n: len(second_prompt) if n == name else 0 for n in after}
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].token_ids == offline_tokens(
        offline, second_prompt, max_tokens=6, **GREEDY
    )
    service.coordinator.clear_caches.remote().result()  # index and engines agree again
    index = ray.get(router.stats.remote())
    assert (index["num_blocks"], index["num_snapshots"]) == (0, 0)
    assert_nothing_held(service)


# ---- scenarios 8 and 31: on a deployment of their own -----------------------------------


def test_the_prefill_engine_killed_mid_hand_off_leaves_decode_serving(faults, offline):
    """`ray.kill` of the prefill engine while it hands a request off (the transfer in
    flight): the client gets the complete answer, recomputed by the decode engine (the
    offline tokens, [DONE]); the dead engine leaves routing and the index (it held the
    prompt's blocks); the decode engine is at baseline and serves a later probe alone."""
    engines = faults.engines()
    prefill, decode = engines["prefill-0"], engines["decode-0"]
    router = faults.topology()["router"]
    prompt = fresh_prompt(801, 40)
    salt = derive_cache_salt(API_KEY, None)  # a key without a tenant is its own tenant
    expected = offline_tokens(offline, prompt, max_tokens=24, **GREEDY)
    outcome: dict[str, bytes] = {}

    def run() -> None:
        outcome["raw"] = stream_raw(
            faults, {"prompt": prompt, "max_tokens": 24, **GREEDY}, lambda first: None
        )

    with injected([decode], _hold_receives, _resume_receives):
        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: stats(prefill)["transfers_in_flight"] == 1, "the hand-off")
        wait_for(
            lambda: ray.get(router.score.remote(prompt, salt))["prefill-0"]["attention_tokens"],
            "the prompt's blocks in the index",
        )
        ray.kill(prefill)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request never ended"
    events = sse_events(outcome["raw"])
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert streamed_token_ids(events) == expected
    assert "prefill-0" not in faults.engines()
    assert ray.get(router.stats.remote())["engines"] == ["decode-0"]
    assert "prefill-0" not in ray.get(router.score.remote(prompt, salt))
    assert_nothing_held(faults)
    probe = client(faults).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert probe.choices[0].token_ids == expected


def test_a_graceful_shutdown_ends_every_request_in_flight(faults, offline):
    """The deployment is deleted (Serve's shutdown: the Coordinator drains its engines for
    drain_timeout_s) while requests stream: each one ends before the deadline, either
    complete (the offline tokens, [DONE]) or, when it cannot finish in time, with exactly
    one error event saying the engine shut down; none hangs."""
    short, long_ = 40, 3000  # 3000 tokens take far longer than the drain allows
    prompts = {"0": PROMPT, "1": PROMPT + " again"}
    expected = {
        k: offline_tokens(offline, p, max_tokens=short, **GREEDY) for k, p in prompts.items()
    }
    bodies = {
        f"{kind}-{k}": {"prompt": prompt, "max_tokens": short if kind == "short" else long_}
        for kind in ("short", "long")
        for k, prompt in prompts.items()
    }
    started = threading.Barrier(len(bodies) + 1, timeout=60)
    ended: dict[str, bytes] = {}

    def run(name: str) -> None:
        def first_token(_: dict[str, Any]) -> None:
            started.wait()

        ended[name] = stream_raw(faults, bodies[name] | GREEDY, first_token)

    threads = [threading.Thread(target=run, args=(name,)) for name in bodies]
    for thread in threads:
        thread.start()
    started.wait()  # every request has its first token
    deadline = time.monotonic() + DRAIN_TIMEOUT_S + 30
    serve.delete("hybridserve-faults")
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert sorted(ended) == sorted(bodies), "a request hung"
    for name, raw in ended.items():
        kind, k = name.split("-")
        if kind == "short":
            events = sse_events(raw)
            assert events[-1] == "[DONE]", (name, events[-2:])
            assert streamed_token_ids(events) == expected[k]
        else:
            events = assert_ends_in_one_error(raw, "shut down before the request finished")
            tokens = streamed_token_ids(events)  # a prefix of the answer, however far it got
            assert tokens[:short] == expected[k][: len(tokens)]
