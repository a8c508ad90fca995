"""One engine in its own OS process, for the two-process transfer tests (not shipped).

    python tests/transceiver/peer_process.py decode MODEL BACKEND [ENGINE_ARGS_JSON]
        prints {"address": [host, port]}, then one JSON line per finished request
    python tests/transceiver/peer_process.py prefill MODEL BACKEND [ENGINE_ARGS_JSON]
        reads the decode process's HOST:PORT as its first line (so both start at once), then
        one JSON command per line: {"requests": [{"id", "prompt", "params", "salt"}]}, and
        prints one JSON line per transfer outcome, then {"batch_done": n}

Both end on stdin EOF.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from hybridserve.transceiver.base import Pools
from hybridserve.transceiver.endpoint import TransferReceiver, TransferSender
from hybridserve.transceiver.registry import create_backend
from hybridserve.workers import Engine, EngineConfig, SamplingParams

# Both processes run this script, so they share the secret (the Coordinator's role).
TRANSFER_SECRET = "5e" * 32


def emit(payload: dict) -> None:
    print(json.dumps(payload), flush=True)


def engine_for(role: str, model: str, backend: str, extra: str | None) -> Engine:
    args = json.loads(extra) if extra else {}
    return Engine(EngineConfig(model=model, role=role, transfer_backend=backend, **args))


def run_decode(model: str, backend: str, extra: str | None) -> None:
    engine = engine_for("decode", model, backend, extra)
    lock = threading.Lock()
    receiver = TransferReceiver(
        engine.decode_port,
        engine.layout,
        create_backend(backend, Pools.of(engine.caches), engine.config.transfer_streams),
        secret=TRANSFER_SECRET,
        lock=lock,
        host="127.0.0.1",
    )
    emit({"address": list(receiver.address)})
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            with lock:
                outputs = engine.step() if engine.has_unfinished_requests() else []
            for out in outputs:
                if out.finished:
                    emit(
                        {
                            "request_id": out.request_id,
                            "token_ids": out.token_ids,
                            "finish_reason": out.finish_reason,
                            "error": out.error,
                            "num_cached_tokens": out.num_cached_tokens,
                        }
                    )
            if not outputs:
                time.sleep(0.002)

    stepping = threading.Thread(target=loop, daemon=True)
    stepping.start()
    sys.stdin.read()  # until EOF
    stop.set()
    stepping.join()
    receiver.close()
    with lock:
        engine.check_integrity()


def run_prefill(model: str, backend: str, extra: str | None) -> None:
    engine = engine_for("prefill", model, backend, extra)
    address = sys.stdin.readline().strip()
    if not address:  # the test ended before it had one
        return
    host, port = address.rsplit(":", 1)
    lock = threading.Lock()
    sender = TransferSender(
        engine.prefill_port,
        engine.layout,
        create_backend(backend, Pools.of(engine.caches), engine.config.transfer_streams),
        (host, int(port)),
        secret=TRANSFER_SECRET,
        lock=lock,
    )
    for line in sys.stdin:
        command = json.loads(line)
        for spec in command["requests"]:
            engine.add_request(
                spec["prompt"],
                SamplingParams(**spec["params"]),
                request_id=spec["id"],
                cache_salt=spec.get("salt"),
            )
        sent = 0
        while engine.has_unfinished_requests() or sent < len(command["requests"]):
            with lock:
                outputs = engine.step()
            finished_here = [o for o in outputs if o.finished]
            for out in finished_here:  # finished by its first token: nothing to transfer
                emit(
                    {
                        "request_id": out.request_id,
                        "status": "finished_on_prefill",
                        "token_ids": out.token_ids,
                    }
                )
                sent += 1
            for handoff in engine.prefill_port.take_handoffs():
                outcome = sender.send(handoff.request.request_id, handoff.message)
                emit(
                    {
                        "request_id": outcome.request_id,
                        "status": outcome.status,
                        "detail": outcome.detail,
                        "blocks_sent": outcome.blocks_sent,
                        "blocks_held": outcome.blocks_held,
                        "num_cached_tokens": handoff.request.num_cached_tokens,
                    }
                )
                sent += 1
        emit({"batch_done": sent})
    sender.close_link()
    engine.check_integrity()


if __name__ == "__main__":
    role, model, backend, *rest = sys.argv[1:]
    if role == "decode":
        run_decode(model, backend, rest[0] if rest else None)
    else:
        run_prefill(model, backend, rest[0] if rest else None)
