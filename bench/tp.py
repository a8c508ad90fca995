"""Where a tensor-parallel step's time goes: compute against collectives, at TP 1, 2 and 4.

    python bench/tp.py [--quick] [--tp 1 2 4] [--device cpu|cuda] [--output bench/results/tp.json]

The benchmark's random NemotronH checkpoint (bench/common.py: hidden 512, 12 layers, fp32) runs
two workloads per TP size, one engine each:
- decode: 8 requests decoding together (64-token prompts, 64 output tokens), decode-only steps;
- prefill: three 1024-token prompts, one after the other, each in one step.
Per step, measured on rank 0: wall time of the whole step (every rank's cache ops, forward and
collectives; rank 0's sampling), time inside collectives (all-reduces and the logits gather;
with --device cuda, synchronised around each call), and the bytes all-reduced per token. Compute
is the rest. On the CPU the ranks share the machine's cores (each gets cores / tp threads), so
TP > 1 is not expected to be faster there; the split shows what the collectives cost.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import build_checkpoint, machine, write_result
from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.core.step_plan import StepPlan
from hybridserve.workers.executors.distributed import TorchCollectives

DECODE_REQUESTS, DECODE_PROMPT, DECODE_OUTPUT = 8, 64, 64
PREFILL_PROMPT, PREFILL_REPEATS = 1024, 3


@dataclass
class StepFigures:
    steps: int
    tokens_per_step: float
    step_ms: float
    collective_ms: float
    compute_ms: float
    collective_calls_per_step: float
    all_reduce_bytes_per_token: float
    gather_bytes_per_step: float


class StepRecorder:
    """Wraps an engine's executor: per step, wall time and rank 0's collective counters."""

    def __init__(self, llm: LLM) -> None:
        self.executor = llm.engine.executor
        collectives = self.executor.driver.parallel.collectives
        self.collectives = collectives if isinstance(collectives, TorchCollectives) else None
        if self.collectives is not None and self.executor.driver.device.type == "cuda":
            self.collectives.synchronize = True
        self.records: list[dict[str, Any]] = []
        inner = self.executor.execute

        def execute(plan: StepPlan) -> Any:
            if self.collectives is not None:
                self.collectives.stats.reset()
            if self.executor.driver.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = inner(plan)
            if self.executor.driver.device.type == "cuda":
                torch.cuda.synchronize()
            stats = self.collectives.stats if self.collectives is not None else None
            self.records.append(
                {
                    "decode_only": bool(plan.chunks) and all(c.is_decode for c in plan.chunks),
                    "tokens": plan.num_tokens,
                    "seconds": time.perf_counter() - start,
                    "collective_seconds": stats.seconds if stats else 0.0,
                    "calls": stats.num_calls if stats else 0,
                    "all_reduce_bytes": stats.bytes_all_reduced if stats else 0,
                    "gather_bytes": stats.bytes_gathered if stats else 0,
                }
            )
            return result

        self.executor.execute = execute  # type: ignore[method-assign]

    def figures(self, records: list[dict[str, Any]]) -> StepFigures:
        step = statistics.median(r["seconds"] for r in records)
        collective = statistics.median(r["collective_seconds"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        return StepFigures(
            steps=len(records),
            tokens_per_step=tokens / len(records),
            step_ms=step * 1e3,
            collective_ms=collective * 1e3,
            compute_ms=(step - collective) * 1e3,
            collective_calls_per_step=statistics.mean(r["calls"] for r in records),
            all_reduce_bytes_per_token=sum(r["all_reduce_bytes"] for r in records) / tokens,
            gather_bytes_per_step=statistics.mean(r["gather_bytes"] for r in records),
        )


def measure(folder: Path, tp: int, device: str, quick: bool) -> dict[str, Any]:
    scale = 4 if quick else 1
    gen = torch.Generator().manual_seed(tp)
    decode_prompts = [
        torch.randint(1, 4096, (DECODE_PROMPT // scale,), generator=gen).tolist()
        for _ in range(DECODE_REQUESTS)
    ]
    prefill_prompts = [
        torch.randint(1, 4096, (PREFILL_PROMPT // scale,), generator=gen).tolist()
        for _ in range(PREFILL_REPEATS)
    ]
    with LLM(
        str(folder),
        tensor_parallel_size=tp,
        device=device,
        max_num_seqs=DECODE_REQUESTS,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        enable_prefix_caching=False,  # every step computes what it says
    ) as llm:
        recorder = StepRecorder(llm)
        warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        llm.generate(decode_prompts[:2], warm, use_tqdm=False)
        recorder.records.clear()
        decode = SamplingParams(max_tokens=DECODE_OUTPUT // scale, temperature=0.0, ignore_eos=True)
        llm.generate(decode_prompts, decode, use_tqdm=False)
        decode_steps = [r for r in recorder.records if r["decode_only"]]
        recorder.records.clear()
        for prompt in prefill_prompts:
            llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill_steps = [r for r in recorder.records if r["tokens"] == len(prefill_prompts[0])]
        return {
            "tp": tp,
            "decode": asdict(recorder.figures(decode_steps)),
            "prefill": asdict(recorder.figures(prefill_steps)),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small checkpoint and workloads")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--output", default="bench/results/tp.json")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < max(args.tp):
        raise SystemExit(f"--tp {max(args.tp)} needs that many GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        build_checkpoint(folder, args.quick)
        results = [measure(folder, tp, args.device, args.quick) for tp in args.tp]
    print(
        f"{'tp':>3} {'workload':>8} {'tokens/step':>11} {'step ms':>8} {'compute ms':>10} "
        f"{'collect. ms':>11} {'calls/step':>10} {'AR bytes/token':>14}"
    )
    for result in results:
        for workload in ("decode", "prefill"):
            f = result[workload]
            print(
                f"{result['tp']:>3} {workload:>8} {f['tokens_per_step']:>11.1f} "
                f"{f['step_ms']:>8.2f} {f['compute_ms']:>10.2f} {f['collective_ms']:>11.2f} "
                f"{f['collective_calls_per_step']:>10.1f} {f['all_reduce_bytes_per_token']:>14.0f}"
            )
    write_result(
        args.output,
        {
            "benchmark": "tp",
            "device": args.device,
            "quick": args.quick,
            "machine": machine(),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
