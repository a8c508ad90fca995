"""Multi-turn chat TTFT with snapshot reuse, without reuse, and the compute-only limit.

    python bench/multiturn_offline.py [--family nemotron_h|qwen3_5] [--quick] [--output ...]

One conversation on the mid-size random checkpoint of the family (NemotronH-style or
Qwen3.5-style, hidden 512, 12 layers, fp32): a system prompt, then turns of a user message plus the
model's own answer, until the history passes 4k tokens. Each turn's prompt goes through two engines
in the same run: one with prefix caching (it resumes from the previous turn's prompt-end snapshot)
and one without. Per turn we report

- TTFT with reuse: add_request until the first output token, everything included;
- TTFT without reuse: the same prompt computed from scratch;
- the compute-only limit: the model-runner time of the steps that prefilled the uncached suffix
  in the reuse engine (the same forward passes, without scheduling, lookup, copies);

and at the end the snapshot bytes per request and the reuse statistics.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import (
    FAMILIES,
    add_family_arguments,
    build_checkpoint,
    machine,
    output_path,
    write_result,
)
from hybridserve.workers import Engine, EngineConfig, SamplingParams


class TimedEngine:
    """An engine whose runner time per request is recorded (the compute-only limit)."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = Engine(config)
        self.runner_seconds = 0.0
        execute = self.engine.executor.execute

        def timed(plan: Any) -> Any:
            start = time.perf_counter()
            result = execute(plan)
            self.runner_seconds += time.perf_counter() - start
            return result

        self.engine.executor.execute = timed  # type: ignore[method-assign]

    def first_token(self, prompt: list[int], params: SamplingParams) -> tuple[float, float, Any]:
        """(TTFT, runner seconds until the first token, request output when finished)."""
        engine = self.engine
        self.runner_seconds = 0.0
        start = time.perf_counter()
        request_id = engine.add_request(prompt, params)
        ttft = runner = 0.0
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if not ttft and output.token_ids:
                    ttft, runner = time.perf_counter() - start, self.runner_seconds
                if output.finished:
                    final = output
        return ttft, runner, final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and conversation")
    add_family_arguments(parser, "multiturn_offline")
    args = parser.parse_args()

    system_len, user_len, answer_len, min_history = (
        (64, 48, 16, 400) if args.quick else (256, 256, 64, 4096)
    )
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 4096, (n,), generator=gen).tolist()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(Path(tmp), args.quick, args.family)
        common = dict(model=tmp, max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=4)
        reuse = TimedEngine(EngineConfig(**common, snapshot_interval=0))
        scratch = TimedEngine(EngineConfig(**common, enable_prefix_caching=False))
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for engine in (reuse, scratch):
            engine.first_token(tokens(64), warm)
        reuse.engine.clear_cache()
        answer = SamplingParams(max_tokens=answer_len, temperature=0.0, ignore_eos=True)
        history = tokens(system_len)
        turn = 0
        while True:
            turn += 1
            prompt = history + tokens(user_len)
            ttft_reuse, limit, out = reuse.first_token(prompt, answer)
            ttft_scratch, _, _ = scratch.first_token(prompt, warm)
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": len(prompt),
                    "cached_tokens": out.num_cached_tokens,
                    "ttft_reuse_s": ttft_reuse,
                    "ttft_no_reuse_s": ttft_scratch,
                    "compute_limit_s": limit,
                    "reuse_over_limit": ttft_reuse / limit,
                    "speedup_vs_no_reuse": ttft_scratch / ttft_reuse,
                }
            )
            history = prompt + out.token_ids
            if len(prompt) >= min_history:
                break
        cache = reuse.engine.cache
        caches = reuse.engine.caches
        slot_bytes = sum(t[0].numel() * t.element_size() for t in caches.state.values())
        stats = cache.stats

    print(
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'reuse ms':>9} {'limit ms':>9} "
        f"{'no-reuse ms':>11} {'reuse/limit':>11} {'speedup':>8}"
    )
    for row in rows:
        print(
            f"{row['turn']:>4} {row['prompt_tokens']:>6} {row['cached_tokens']:>6} "
            f"{row['ttft_reuse_s'] * 1e3:>9.1f} {row['compute_limit_s'] * 1e3:>9.1f} "
            f"{row['ttft_no_reuse_s'] * 1e3:>11.1f} {row['reuse_over_limit']:>11.2f} "
            f"{row['speedup_vs_no_reuse']:>7.1f}x"
        )
    last = rows[-1]
    print(
        f"last turn: reuse TTFT {last['reuse_over_limit']:.2f}x the compute-only limit, "
        f"{last['speedup_vs_no_reuse']:.1f}x faster than no reuse"
    )
    print(
        f"snapshot bytes per request: {slot_bytes} (one prompt-end snapshot); "
        f"hits {stats.hits}/{stats.lookups}, reused {stats.reused_tokens} tokens, "
        f"unreused {stats.unreused_tokens}"
    )
    result = {
        "benchmark": "multiturn_offline",
        "quick": args.quick,
        "family": args.family,
        "model": FAMILIES[args.family],
        "config": {
            "save_last_snapshot": True,
            "snapshot_interval": 0,
            "block_size": 16,
            "system_tokens": system_len,
            "user_tokens": user_len,
            "answer_tokens": answer_len,
        },
        "machine": machine(),
        "turns": rows,
        "snapshot_bytes_per_request": slot_bytes,
        "cache_stats": stats.__dict__,
    }
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
