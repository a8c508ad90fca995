"""Engine throughput against HF transformers `generate`, side by side in one run.

    python bench/engine_vs_hf.py [--family nemotron_h|qwen3_5] [--quick] [--output ...]

A mid-size random checkpoint of the family (NemotronH-style or Qwen3.5-style, hidden 512, 12
layers, fp32; big enough that model compute dominates) is built with transformers, then for 1, 8
and 32 concurrent requests the same workload runs through our engine (continuous batching, at most
N running) and through `generate` (static batches of N, left-padded to the longest prompt, decoding
until the longest output is done). Each request has its own prompt length and output length (EOS
ignored), so output tokens/s counts only tokens some request asked for. Also: prefill tokens/s for
one 2k-token prompt. Ratios are ours / HF.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridserve.bench.common import (
    FAMILIES,
    Workload,
    add_family_arguments,
    build_checkpoint,
    comparison_workloads,
    machine,
    output_path,
    run_ours,
    workload_ranges,
    write_result,
)
from hybridserve.workers import LLM, SamplingParams


@torch.no_grad()
def run_hf(model: torch.nn.Module, workload: Workload) -> float:
    n = workload.concurrency
    prompt = torch.tensor([workload.prompts[0]])
    model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # warm-up, as for ours
        max_new_tokens=workload.output_lens[0],
        do_sample=False,
        pad_token_id=0,
    )
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), n):
        prompts = workload.prompts[first : first + n]
        longest = max(len(p) for p in prompts)
        input_ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        new_tokens = max(workload.output_lens[first : first + n])
        model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - start


@torch.no_grad()
def prefill_rates(
    folder: Path, model: torch.nn.Module, prompt_len: int, repeats: int
) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(7)
    llm = LLM(str(folder), max_num_batched_tokens=prompt_len)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ours, theirs = [], []
    for _ in range(repeats + 1):  # the first round warms up both
        # A fresh prompt each round: a repeated one would be served from the prefix cache.
        prompt = torch.randint(1, 4096, (prompt_len,), generator=generator)
        start = time.perf_counter()
        (out,) = llm.generate([prompt.tolist()], one, use_tqdm=False)
        ours.append(time.perf_counter() - start)
        assert out.num_cached_tokens == 0, "a prefill measurement must compute every token"
        start = time.perf_counter()
        model.generate(
            prompt[None],
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=0,
        )
        theirs.append(time.perf_counter() - start)
    return prompt_len / statistics.median(ours[1:]), prompt_len / statistics.median(theirs[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and workload (smoke)")
    add_family_arguments(parser, "engine_vs_hf")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; best is kept")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    prompt_range, output_range = workload_ranges(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder, args.quick, args.family)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        rows = []
        for workload in comparison_workloads(args.quick):
            concurrency, num_requests = workload.concurrency, len(workload.prompts)
            # Alternate the two systems and keep each one's best time: this VM's timing noise
            # is additive (other tenants), so the minimum is the steadiest estimate.
            ours = theirs = float("inf")
            for _ in range(args.repeats):
                ours = min(ours, run_ours(folder, workload))
                theirs = min(theirs, run_hf(model, workload))
            tokens = workload.num_output_tokens
            rows.append(
                {
                    "concurrency": concurrency,
                    "num_requests": num_requests,
                    "output_tokens": tokens,
                    "ours_output_tokens_per_s": tokens / ours,
                    "hf_output_tokens_per_s": tokens / theirs,
                    "ratio": theirs / ours,
                }
            )
        prompt_len = 256 if args.quick else 2048
        ours_prefill, hf_prefill = prefill_rates(folder, model, prompt_len, 1 if args.quick else 3)

    print(f"{'concurrency':>11} {'requests':>8} {'ours tok/s':>11} {'HF tok/s':>9} {'ratio':>6}")
    for row in rows:
        print(
            f"{row['concurrency']:>11} {row['num_requests']:>8} "
            f"{row['ours_output_tokens_per_s']:>11.1f} {row['hf_output_tokens_per_s']:>9.1f} "
            f"{row['ratio']:>5.2f}x"
        )
    print(
        f"prefill {prompt_len} tokens: ours {ours_prefill:.0f} tok/s, HF {hf_prefill:.0f} tok/s, "
        f"ratio {ours_prefill / hf_prefill:.2f}x"
    )
    result = {
        "benchmark": "engine_vs_hf",
        "quick": args.quick,
        "family": args.family,
        "model": FAMILIES[args.family],
        "workload": {
            "prompt_len_range": prompt_range,
            "output_len_range": output_range,
            "ignore_eos": True,
            "hf_batching": "static batches of `concurrency`, "
            "left padding, decode to the batch's longest output",
        },
        "machine": machine(),
        "repeats": args.repeats,
        "throughput": rows,
        "prefill": {
            "prompt_len": prompt_len,
            "ours_tokens_per_s": ours_prefill,
            "hf_tokens_per_s": hf_prefill,
            "ratio": ours_prefill / hf_prefill,
        },
    }
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
