"""Faults injected inside engine actors (run there through `__ray_call__`), and the helpers
the fault-matrix scenarios (test_fault_matrix.py) share: polling, engine stats, raw HTTP and
SSE requests, and the checks that the service holds nothing afterwards."""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import ray

from tests.service import API_KEY, PROMPT, Service, assert_at_baseline, client

# The functions below that run inside engine actors travel by value: importing this module
# there (and the client libraries it imports) would cost each engine process seconds.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROBE_TOKENS = 8


# ---- faults injected inside an engine actor (run there through __ray_call__) --------------


def hold_steps(actor: Any, allowed: int) -> None:
    """The engine runs `allowed` more steps with work, then stalls (its loop keeps beating,
    but no request advances) until `resume_steps`."""
    engine = actor.host.engine
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
        actor.host.lock.release()
        try:
            time.sleep(0.01)
        finally:
            actor.host.lock.acquire()
        return []

    engine.step = step


def resume_steps(actor: Any) -> None:
    vars(actor.host.engine).pop("step", None)


def hold_receives(actor: Any) -> None:
    """Incoming transfers wait (after their request arrived, before anything is reserved)
    until `resume_receives`; `receives_done` counts those handled since."""
    receiver = actor.host.links.receiver
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


def resume_receives(actor: Any) -> None:
    vars(actor.host.links.receiver).pop("_receive", None)
    actor.receive_gate.set()


def receives_done(actor: Any) -> int:
    """Transfers the held receiver has handled (landed, failed or refused) since held."""
    return actor.receives_done


def fail_next_step(actor: Any) -> None:
    """The engine's next step raises (then stepping is back to normal)."""
    engine = actor.host.engine

    def step() -> list[Any]:
        del engine.step
        raise RuntimeError("injected: this step fails")

    engine.step = step


def evict_unannounced(actor: Any) -> int:
    """Drop every cached block and snapshot, and hold back the removal events: the prefix
    index keeps saying warm until `announce_held_events`."""
    host, events = actor.host, actor.host.cache_events
    with events._flush_lock, host.lock:
        host.engine.clear_cache()
        actor.held_events, events._pending = events._pending, []
    return len(actor.held_events)


def announce_held_events(actor: Any) -> None:
    """Send the removal events `evict_unannounced` held back (ahead of any newer ones)."""
    host, events = actor.host, actor.host.cache_events
    with events._flush_lock, host.lock:
        events._pending[:0] = actor.held_events
        actor.held_events = []
    events.flush()


def num_streams(actor: Any) -> int:
    """Request streams open on the engine (each is a request some caller still follows)."""
    return len(actor.host._streams)


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


def alive(handle: Any) -> bool:
    """Whether the actor still answers: False once Ray reports it dead (`ray.kill` returns
    before the process is gone)."""
    try:
        ray.get(handle.describe.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.GetTimeoutError:
        pass  # not dead yet as far as Ray knows
    return True


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
        streams = ray.get([h.__ray_call__.remote(num_streams) for h in engines.values()])
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
