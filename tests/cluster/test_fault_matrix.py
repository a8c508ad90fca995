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

import selectors
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import ray
from ray import serve

from hybridserve.cluster.openai.protocol import derive_cache_salt
from hybridserve.workers import LLM
from tests.cluster.fault_injection import (
    HEADERS,
    PROBE_TOKENS,
    alive,
    announce_held_events,
    assert_ends_in_one_error,
    assert_nothing_held,
    assert_probe_served,
    decode_engines,
    evict_unannounced,
    fail_next_step,
    fresh_prompt,
    hold_receives,
    hold_steps,
    injected,
    num_streams,
    open_request,
    receives_done,
    resume_receives,
    resume_steps,
    sse_events,
    stats,
    stream_raw,
    streamed_token_ids,
    wait_for,
)
from tests.service import (
    API_KEY,
    ENGINE,
    PROMPT,
    Service,
    beside,
    client,
    num_aborted,
    offline_tokens,
)

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "ignore_eos": True}
DRAIN_TIMEOUT_S = 2.0
# 1 prefill + 1 decode engine; long outputs, so a shutdown finds requests that cannot finish
# (tiny's longest: 8192 tokens; two 8000-token outputs take ~6 s offline against a 2 s drain,
# where two of 3000 now take 1.3 s).
FAULTS_SERVICE = {
    "num_prefill": 1,
    "num_decode": 1,
    "engine": ENGINE | {"max_model_len": 8192, "num_kv_blocks": 2048},
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
    with injected([prefill], hold_steps, resume_steps, 1):
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
    with injected(decodes, hold_receives, resume_receives):
        sock = open_request(service, {"prompt": prompt, "max_tokens": 700, "ignore_eos": True})
        wait_for(lambda: stats(prefill)["transfers_in_flight"] == 1, "the hand-off")
        sock.close()
        # The abort has reached both sides before the transfer goes on: the prefill engine
        # (its call cancelled) and the decode engine that expected the request.
        wait_for(
            lambda: not any(ray.get([h.__ray_call__.remote(num_streams) for h in engines])),
            "every engine to drop the request's stream",
        )
    wait_for(
        lambda: sum(ray.get([h.__ray_call__.remote(receives_done) for h in decodes])) == 1,
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
    before = num_aborted(service)
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
    # Aborted where it ran (the decode engine took it over before the first token came),
    # not left to finish its 700 tokens.
    assert num_aborted(service) > before
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
        ray.get(running.__ray_call__.remote(fail_next_step))

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
        assert ray.get(engine.__ray_call__.remote(evict_unannounced)) > 0
        assert holder() == name  # stale: the index still says warm
        before = {n: stats(h)["num_prompt_tokens_computed"] for n, h in service.engines().items()}
        second = client(service).completions.create(
            model="tiny", prompt=second_prompt, max_tokens=6, **params
        )
        after = {n: stats(h)["num_prompt_tokens_computed"] for n, h in service.engines().items()}
    finally:
        ray.get(engine.__ray_call__.remote(announce_held_events))
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


def test_a_killed_router_is_replaced_with_its_index_rebuilt_and_nothing_lost(faults, offline):
    """`ray.kill` of the router while requests run and more arrive: every request ends with
    the offline engine's tokens (a route that met the dead router is retried on the router
    that replaces it), the Coordinator replaces the router, and the new router's index is
    rebuilt from what the engines hold: a finished turn scores as it did before the kill."""
    params = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    api = client(faults)
    first = fresh_prompt(851, 60)
    answer = api.completions.create(model="tiny", prompt=first, max_tokens=16, **params)
    follow_up = [*first, *answer.choices[0].token_ids, 5, 6, 7]
    salt = derive_cache_salt(API_KEY, None)
    old = faults.topology()

    def scores(router: Any) -> dict[str, Any]:
        return ray.get(router.score.remote(follow_up, salt))

    def turn_indexed() -> dict[str, Any] | None:
        held = scores(old["router"])
        return held if held["decode-0"]["snapshot_tokens"] == len(first) + 15 else None

    before = wait_for(turn_indexed, "the first turn's turn-end snapshot in the index")
    prompts = [fresh_prompt(861 + i, 30 + 7 * i) for i in range(6)]
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        reply = api.completions.create(model="tiny", prompt=prompts[i], max_tokens=24, **params)
        results[i] = reply.choices[0].token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads[:3]:
        thread.start()
    time.sleep(0.2)
    ray.kill(old["router"])
    for thread in threads[3:]:  # routed after the kill: through the router that replaces it
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert {i: results.get(i) for i in range(6)} == {
        i: offline_tokens(offline, prompts[i], max_tokens=24, **GREEDY) for i in range(6)
    }
    new = faults.topology()
    assert new["router_id"] != old["router_id"] and not alive(old["router"])
    assert scores(new["router"]) == before
    index = ray.get(new["router"].stats.remote())
    assert index["num_blocks"] > 0 and index["engines"] == ["prefill-0", "decode-0"]
    assert_nothing_held(faults)


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

    with injected([decode], hold_receives, resume_receives):
        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: stats(prefill)["transfers_in_flight"] == 1, "the hand-off")
        wait_for(
            lambda: ray.get(router.score.remote(prompt, salt))["prefill-0"]["attention_tokens"],
            "the prompt's blocks in the index",
        )
        ray.kill(prefill)
        # Dead before the decode engine's receive goes on: else that receive can land and
        # ack, and the prefill engine's result reach the ingress, before the kill does.
        wait_for(lambda: not alive(prefill), "the prefill engine's death")
    thread.join(timeout=60)
    assert not thread.is_alive(), "the request never ended"
    events = sse_events(outcome["raw"])
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert streamed_token_ids(events) == expected
    # Out of routing: reported by the ingress's feed from it (or by the health checks).
    wait_for(lambda: "prefill-0" not in faults.engines(), "the dead engine out of the topology")
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
    short, long_ = 40, 8000  # 8000 tokens take far longer than the drain allows
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
