"""An FP8 KV cache against the float one: where greedy tokens first differ, how far the
log-probabilities move, and what the cache costs.

    python bench/kv_cache_dtype.py [--family qwen3_5|nemotron_h] [--quick]

On the family's mid-size random checkpoint (bench/common.py, fp32), two engines with prefix
caching off run one workload (16 prompts of 256-1024 tokens, 64 greedy tokens each):
`kv_cache_dtype: auto` (float32) and `fp8` (e4m3, scales 1.0). Reported:

- per request, the first generated position whose token differs (none: all 64 equal);
- teacher-forced, so that both engines score the same text: each prompt plus the float
  engine's continuation goes through both as a prompt, and at every continuation position the
  log-probabilities of the float engine's 20 most likely tokens are compared (the logits up
  to each position's normaliser; the API returns no raw logits): their mean and largest
  absolute difference;
- the KV cache's bytes per token, and so the blocks a given memory holds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import (
    add_family_arguments,
    build_checkpoint,
    machine,
    output_path,
    write_result,
)
from hybridserve.workers import LLM, SamplingParams

TOP = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_family_arguments(parser, "kv_cache_dtype")
    parser.set_defaults(family="qwen3_5")
    parser.add_argument("--quick", action="store_true", help="a small checkpoint and workload")
    args = parser.parse_args()
    count, lengths, new_tokens = (4, (32, 96), 16) if args.quick else (16, (256, 1024), 64)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(1, 4096, (int(n),), generator=gen).tolist()
        for n in torch.randint(lengths[0], lengths[1] + 1, (count,), generator=gen)
    ]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "checkpoint"
        build_checkpoint(folder, args.quick, args.family)
        runs: dict[str, Any] = {}
        for dtype in ("auto", "fp8"):
            with LLM(str(folder), kv_cache_dtype=dtype, enable_prefix_caching=False) as llm:
                outputs = llm.generate(prompts, greedy, use_tqdm=False)
                if dtype == "auto":
                    texts = [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)]
                scored = llm.generate(texts, scoring, use_tqdm=False)
                runs[dtype] = {
                    "tokens": [o.token_ids for o in outputs],
                    "scores": [o.prompt_logprobs for o in scored],
                    "kv_bytes_per_token": llm.engine.executor.driver.kv_bytes_per_block()
                    / llm.engine.config.block_size,
                }

    divergence: list[int | None] = []
    for ours, reference in zip(runs["fp8"]["tokens"], runs["auto"]["tokens"], strict=True):
        pairs = enumerate(zip(ours, reference, strict=True))
        divergence.append(next((i for i, (a, b) in pairs if a != b), None))
    differences = []
    for p, ours, reference in zip(prompts, runs["fp8"]["scores"], runs["auto"]["scores"],
                                  strict=True):  # fmt: skip
        for mine, theirs in zip(ours[len(p) :], reference[len(p) :], strict=True):
            own = dict(mine.top)
            differences += [abs(own[t] - lp) for t, lp in theirs.top if t in own]
    diverged = [d for d in divergence if d is not None]
    result = {
        "benchmark": "kv_cache_dtype",
        "family": args.family,
        "machine": machine(),
        "requests": count,
        "new_tokens": new_tokens,
        "identical_requests": divergence.count(None),
        "first_divergence": divergence,
        "median_first_divergence": statistics.median(diverged) if diverged else None,
        "mean_abs_logprob_diff": statistics.fmean(differences),
        "max_abs_logprob_diff": max(differences),
        "kv_bytes_per_token": {k: v["kv_bytes_per_token"] for k, v in runs.items()},
    }
    print(f"requests with all {new_tokens} tokens equal: {result['identical_requests']}/{count}")
    print(f"first differing position of the others: {diverged} "
          f"(median {result['median_first_divergence']})")  # fmt: skip
    print(
        f"teacher-forced |d log-prob| over each position's top {TOP}: mean "
        f"{result['mean_abs_logprob_diff']:.2e}, max {result['max_abs_logprob_diff']:.2e}"
    )
    print("KV bytes per token: " + ", ".join(
        f"{k} {v:.0f}" for k, v in result["kv_bytes_per_token"].items()))  # fmt: skip
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
