"""Async scheduling against synchronous scheduling: a decode step's wall time and the share of
it in which the ranks wait for the engine's thread, side by side.

    python bench/async_scheduling.py [--quick] [--running 1 8 64 256] [--device cpu|cuda]
                                     [--dtype float32|bfloat16] [--repeats 3] [--output ...]

One engine per mode on the benchmark's random NemotronH checkpoint (bench/common.py; --quick:
the small one), prefix caching on as served, the forward paths the engine picks by default. N
requests with 64-token prompts decode together; once all N run, `STEPS` decode steps are
timed. Per step: the wall time, and `host-visible`: the share of the wall time in which the
rank was not running a plan (the engine's own work that the rank waited for: scheduling,
settling, outputs). Synchronous scheduling exposes all of it; async scheduling hides what the
engine's thread does while the rank computes. The modes alternate, each keeping its best of
`--repeats` runs; the ratio is synchronous over async step time.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import build_checkpoint, machine, write_result
from hybridserve.workers import LLM, SamplingParams

PROMPT_LEN, STEPS = 64, 40


class BusyClock:
    """Sums the seconds the rank spends in `ModelRunner.execute` (on whatever thread)."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        runner = llm.engine.executor.driver
        inner = runner.execute

        def timed(plan: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(plan)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - start

        runner.execute = timed  # type: ignore[method-assign]


def measure(llm: LLM, clock: BusyClock, num_running: int, vocab: int) -> dict[str, float]:
    engine = llm.engine
    gen = torch.Generator().manual_seed(num_running)
    params = SamplingParams(max_tokens=STEPS + 8, temperature=0.0, ignore_eos=True)
    for _ in range(num_running):
        engine.add_request(torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist(), params)
    while len(engine.scheduler.running) < num_running or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()  # prompts
    busy = clock.seconds
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    wall = time.perf_counter() - start
    busy = clock.seconds - busy
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": wall / STEPS * 1e3, "host_visible": max(0.0, 1.0 - busy / wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small checkpoint")
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="bench/results/async_scheduling.json")
    args = parser.parse_args()
    most = max(args.running)
    best: dict[tuple[str, int], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder, quick=args.quick)
        for _ in range(args.repeats):
            for mode in ("sync", "async"):
                with LLM(
                    str(folder),
                    max_num_seqs=most,
                    max_num_batched_tokens=max(2048, most),
                    max_model_len=PROMPT_LEN + STEPS + 24,
                    num_kv_blocks=most * 8 + 64,
                    device=args.device,
                    dtype=args.dtype,
                    async_scheduling=mode == "async",
                ) as llm:
                    clock = BusyClock(llm)
                    vocab = llm.engine.model_config.vocab_size
                    measure(llm, clock, min(4, most), vocab)  # warm-up
                    for n in args.running:
                        result = measure(llm, clock, n, vocab)
                        kept = best.get((mode, n))
                        if kept is None or result["step_ms"] < kept["step_ms"]:
                            best[(mode, n)] = result
    rows = []
    print(
        f"{'running':>8} {'sync step':>10} {'async step':>11} {'sync/async':>10} "
        f"{'host-visible sync':>18} {'async':>7}"
    )
    for n in args.running:
        sync, ahead = best[("sync", n)], best[("async", n)]
        row = {
            "running": n,
            "sync_step_ms": sync["step_ms"],
            "async_step_ms": ahead["step_ms"],
            "speedup": sync["step_ms"] / ahead["step_ms"],
            "sync_host_visible": sync["host_visible"],
            "async_host_visible": ahead["host_visible"],
        }
        rows.append(row)
        print(
            f"{n:>8} {sync['step_ms']:>8.3f}ms {ahead['step_ms']:>9.3f}ms {row['speedup']:>9.2f}x "
            f"{sync['host_visible']:>17.1%} {ahead['host_visible']:>6.1%}"
        )
    write_result(
        args.output,
        {
            "machine": machine(),
            "quick": args.quick,
            "device": args.device,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "steps": STEPS,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
