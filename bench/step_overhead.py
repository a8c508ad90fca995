"""What a step costs outside the model runner: the scheduler and the cache managers, at 1, 2,
32 and 256 running requests.

    python bench/step_overhead.py [--quick] [--running 1 2 32 256] [--modes eager compiled native]
                                  [--device cpu|cuda] [--dtype ...] [--runner model|none]
                                  [--output-len 48] [--output ...]

One engine on the benchmark's random NemotronH checkpoint (bench/common.py; --quick: the small
one) with prefix caching and Mamba snapshots on, as served. N requests with 64-token prompts
decode together; once all N run, each decode-only step is split into: `schedule` (the scheduler
decides, the cache coordinator allocates and logs its ops), `execute` (the model runner: cache
ops, forward, sampling), `update` (the scheduler's `advance` and `settle`: cursors and commits,
tokens appended and stop checks) and the rest of
`Engine.step` (outputs, lease sweeps, cache events). Reported: medians per step, the share
of the step spent outside `execute`, and the step against its floor: the GEMM time of N rows
through every weight matrix, measured in the same run (bench/common.gemm_floor_ms). Each
mode is one engine with one forward path before `eager` (`forward_paths`): `eager` alone,
`compiled` (the compiled decode step), `native` (steps of up to eight decode rows as one C
call: measured at those counts only, where it applies) and, on CUDA, `graphs` (decode steps
replayed as CUDA graphs, the `cuda_graphs` path).

`--runner none` measures the host alone: the engine's ranks are replaced by a stand-in that
does no model work (every sampling chunk draws token 1), so `schedule` and `update` are what a
running request costs the engine's own thread, reported per request too (`--output-len`
lengthens the outputs, for costs that grow with a request's tokens).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import build_checkpoint, gemm_floor_ms, machine, write_result
from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.core.outputs import Sample
from hybridserve.workers.core.step_plan import StepPlan
from hybridserve.workers.runner.model_runner import RunnerOutput
from hybridserve.workers.runner.paths.native import MAX_ROWS as MAX_NATIVE_ROWS

PROMPT_LEN = 64


class Timed:
    """Replaces `owner.name` with a wrapper that records each call's seconds in `seconds`."""

    def __init__(self, owner: Any, name: str) -> None:
        self.seconds: list[float] = []
        self.owner, self.name = owner, name
        self.shadowed = vars(owner).get(name)  # an instance attribute it replaces, if any
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - start)

        setattr(owner, name, timed)

    def restore(self) -> None:
        if self.shadowed is None:
            delattr(self.owner, self.name)  # the instance attribute shadowed the method
        else:
            setattr(self.owner, self.name, self.shadowed)


def no_model(plan: StepPlan) -> RunnerOutput:
    """The ranks' stand-in for `--runner none`: no model work; every sampling chunk draws
    token 1."""
    return RunnerOutput([None if c.sampling is None else Sample((1,)) for c in plan.chunks])


def measure(llm: LLM, num_running: int, vocab: int, output_len: int) -> dict[str, Any]:
    engine = llm.engine
    gen = torch.Generator().manual_seed(num_running)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(num_running):
        engine.add_request(torch.randint(1, vocab, (PROMPT_LEN,), generator=gen).tolist(), params)
    while len(engine.scheduler.running) < num_running or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()  # prompts
    timers = {
        "schedule": Timed(engine.scheduler, "schedule"),
        "execute": Timed(engine.executor, "execute"),
        "advance": Timed(engine.scheduler, "advance"),
        "settle": Timed(engine.scheduler, "settle"),
        "step": Timed(engine, "step"),
    }
    steps = 0
    while all(r.num_output_tokens < output_len - 1 for r in engine.scheduler.running):
        engine.step()
        steps += 1
    for timer in timers.values():
        timer.restore()
    while engine.has_unfinished_requests():
        engine.step()
    per_step = {name: t.seconds for name, t in timers.items()}
    assert {len(s) for s in per_step.values()} == {steps}, "one call of each per step"
    # The scheduler's part after the model: cursors and commits, then the tokens.
    parts = zip(per_step["advance"], per_step["settle"], strict=True)
    per_step["update"] = [advance + settle for advance, settle in parts]
    ms = {name: statistics.median(s) * 1e3 for name, s in per_step.items()}
    rest = [
        step - schedule - execute - update
        for step, schedule, execute, update in zip(
            *(per_step[n] for n in ("step", "schedule", "execute", "update")), strict=True
        )
    ]
    other = statistics.median(rest) * 1e3
    floor = gemm_floor_ms(llm, num_running)
    return {
        "mode": mode_of(llm),
        "running": num_running,
        "steps": steps,
        "step_ms": ms["step"],
        "execute_ms": ms["execute"],
        "schedule_ms": ms["schedule"],
        "update_ms": ms["update"],
        "schedule_update_us_per_request": (ms["schedule"] + ms["update"]) * 1e3 / num_running,
        "other_ms": other,
        "outside_share": (ms["step"] - ms["execute"]) / ms["step"],
        "gemm_floor_ms": floor,
        "step_over_floor": ms["step"] / floor,
    }


# Each mode's forward paths (the mode is named after the path it measures).
MODE_PATHS = {
    "eager": ("eager",),
    "compiled": ("compiled", "eager"),
    "native": ("native", "eager"),
    "graphs": ("cuda_graphs", "eager"),
}


def mode_of(llm: LLM) -> str:
    """The mode an engine really runs: its first path (a path that could not serve is off)."""
    first = llm.engine.executor.driver.paths[0].name
    return next(mode for mode, paths in MODE_PATHS.items() if paths[0] == first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small checkpoint")
    parser.add_argument("--running", type=int, nargs="+", default=[1, 2, 32, 256])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["eager", "compiled", "native", "graphs"],
        default=["eager", "compiled", "native"],
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--runner",
        choices=["model", "none"],
        default="model",
        help="none: no model work, the host alone (one engine, the first mode's)",
    )
    parser.add_argument("--output-len", type=int, default=48, help="tokens each request makes")
    parser.add_argument("--output", default="bench/results/step_overhead.json")
    args = parser.parse_args()
    modes = args.modes[:1] if args.runner == "none" else args.modes
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder, quick=args.quick)
        most = max(args.running)
        results = []
        max_model_len = PROMPT_LEN + args.output_len + 16
        for mode in modes:
            with LLM(
                str(folder),
                max_num_seqs=most,
                max_num_batched_tokens=max(2048, most),
                max_model_len=max_model_len,
                num_kv_blocks=most * -(-max_model_len // 16) + 64,
                forward_paths=MODE_PATHS[mode],
                device=args.device,
                dtype=args.dtype,
            ) as llm:
                vocab = llm.engine.model_config.vocab_size
                if args.runner == "none":
                    llm.engine.executor.execute = no_model  # type: ignore[method-assign]
                measure(llm, min(4, most), vocab, args.output_len)  # warm-up
                running = [n for n in args.running if mode != "native" or n <= MAX_NATIVE_ROWS]
                results += [measure(llm, n, vocab, args.output_len) for n in running]
    print(
        f"{'mode':>8} {'running':>8} {'step':>9} {'execute':>9} {'schedule':>9} {'update':>9} "
        f"{'s+u/req':>8} {'other':>8} {'outside':>8} {'GEMM floor':>11} {'step/floor':>10}"
    )
    for r in results:
        print(
            f"{r['mode']:>8} {r['running']:>8} {r['step_ms']:>7.2f}ms {r['execute_ms']:>7.2f}ms "
            f"{r['schedule_ms']:>7.3f}ms {r['update_ms']:>7.3f}ms "
            f"{r['schedule_update_us_per_request']:>6.2f}us {r['other_ms']:>6.3f}ms "
            f"{r['outside_share']:>7.1%} {r['gemm_floor_ms']:>9.2f}ms "
            f"{r['step_over_floor']:>9.2f}x"
        )
    write_result(
        args.output,
        {
            "machine": machine(),
            "quick": args.quick,
            "device": args.device,
            "dtype": args.dtype,
            "runner": args.runner,
            "output_len": args.output_len,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
