"""Speculative decoding against plain decoding on one engine build, side by side.

    python bench/speculative.py [--family nemotron_h|qwen3_5] [--quick] [--repeats 3]
                                [--num-speculative-tokens 4] [--output ...]

Output tokens/s with and without n-gram speculation, at 1 and 8 concurrent requests (greedy,
EOS ignored, 256 output tokens each, no prefix reuse), on three workloads:

- copy (edit a file): a model whose greedy continuation follows a fixed token permutation
  (the family's random benchmark checkpoint, bench/common.py, with its embedding and LM head
  set so that token t's logits peak at perm(t); every other weight as random as before, so a
  step costs what it costs on the plain checkpoint). The prompt is a 'file' of 512 tokens
  along the permutation with a short edit every 48 tokens, then the file's first token: the
  model writes the file out again, the unedited spans are what n-gram lookup predicts, each
  edit costs a rejection.
- copy, no edits: the same file unedited, so every draft stands: the full-acceptance ceiling
  of this k on this machine.
- random: the plain random checkpoint on random prompts: nothing repeats, so lookup rarely
  proposes; what is left is what speculation costs when it cannot help (a request whose
  drafts keep failing pauses them).
- random, self-draft (one request): the random workload with the target as its own draft
  model: every draft stands, and the draft costs as much as the target, so this is the
  acceptance ceiling, not a speed-up.

The two engines alternate run by run and each keeps its best of `--repeats`; ratios are
speculative over plain. The JSON records acceptance (accepted / proposed draft tokens and
mean tokens per verify step) beside the speeds, and that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hybridserve.bench.common import (
    add_family_arguments,
    build_checkpoint,
    machine,
    output_path,
    write_result,
)
from hybridserve.workers import LLM, SamplingParams

VOCAB, FILE_LEN, EDIT_EVERY, EDIT_LEN = 4096, 512, 48, 3
OUTPUT_TOKENS = 256


def copying_checkpoint(source: Path, target: Path, permutation: torch.Tensor) -> None:
    """`source` with token t's logits peaking at permutation[t]: embeddings of unit-scale
    rows (they dominate the residual stream the random layers add to) and LM head row
    permutation[t] along embedding row t."""
    tensors = load_file(str(source / "model.safetensors"))
    embed_name = next(name for name in tensors if "embed" in name)
    generator = torch.Generator().manual_seed(7)
    embed = torch.randn(tensors[embed_name].shape, generator=generator)
    lm_head = torch.empty_like(embed)
    lm_head[permutation] = embed / embed.norm(dim=1, keepdim=True)
    tensors[embed_name], tensors["lm_head.weight"] = embed, lm_head
    target.mkdir()
    for item in source.iterdir():
        if item.name != "model.safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})


def orbit(permutation: torch.Tensor, start: int, length: int) -> list[int]:
    tokens = [start]
    while len(tokens) < length:
        tokens.append(int(permutation[tokens[-1]]))
    return tokens


def copy_prompts(permutation: torch.Tensor, count: int, edits: bool, seed: int) -> list[list[int]]:
    """Per request: a file along the permutation (edited or not), a separator, and the
    file's first token, from which the model writes it out again."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        start = int(torch.randint(0, VOCAB, (1,), generator=generator))
        file = orbit(permutation, start, FILE_LEN)
        if edits:
            for at in range(EDIT_EVERY, FILE_LEN - EDIT_LEN, EDIT_EVERY):
                file[at : at + EDIT_LEN] = torch.randint(
                    0, VOCAB, (EDIT_LEN,), generator=generator
                ).tolist()
        prompts.append([*file, 1, 2, 3, file[0]])
    return prompts


def random_prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(4, VOCAB, (FILE_LEN,), generator=generator).tolist() for _ in range(count)
    ]


def run(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]], dict[str, int]]:
    """(seconds, the outputs' tokens, speculation counts summed over the requests)."""
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for output in outputs:
        if output.speculation is not None:
            counts["drafts"] += output.speculation.num_drafts
            counts["draft_tokens"] += output.speculation.num_draft_tokens
            counts["accepted_tokens"] += output.speculation.num_accepted_tokens
    return elapsed, [o.token_ids for o in outputs], counts


def compare(
    folder: Path, prompts: list[list[int]], args: argparse.Namespace, draft: Path | None = None
) -> dict[str, Any]:
    """Plain and speculative engines alternating over the same prompts, best of repeats
    (`draft`: speculate with that draft model instead of n-gram lookup)."""
    options = {
        "max_num_seqs": len(prompts),
        "max_model_len": FILE_LEN + OUTPUT_TOKENS + 16,
        "enable_prefix_caching": False,
    }
    speculative: dict[str, Any] = {
        "method": "ngram" if draft is None else "draft_model",
        "model": None if draft is None else str(draft),
        "num_speculative_tokens": args.num_speculative_tokens,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    engines = {
        "plain": LLM(str(folder), **options),
        "speculative": LLM(str(folder), speculative_config=speculative, **options),
    }
    best = {name: float("inf") for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    counts: dict[str, int] = {}
    for llm in engines.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    speculator = engines["speculative"].engine.scheduler.speculator
    assert speculator is not None
    for _ in range(args.repeats):
        for name, llm in engines.items():
            replayed_before = speculator.num_replayed_tokens
            elapsed, tokens[name], run_counts = run(llm, prompts)
            best[name] = min(best[name], elapsed)
            if name == "speculative":
                counts = run_counts | {"replayed": speculator.num_replayed_tokens - replayed_before}
    copy_us = checkpoint_copy_us(engines["speculative"])
    for llm in engines.values():
        llm.shutdown()
    total = OUTPUT_TOKENS * len(prompts)
    return {
        "requests": len(prompts),
        "plain_tok_s": total / best["plain"],
        "speculative_tok_s": total / best["speculative"],
        "ratio": best["plain"] / best["speculative"],
        "acceptance_rate": counts["accepted_tokens"] / max(counts["draft_tokens"], 1),
        "tokens_per_verify_step": 1 + counts["accepted_tokens"] / max(counts["drafts"], 1),
        "verify_steps": counts["drafts"],
        # Checkpoint and replay: the tokens computed again after rollbacks, per output token,
        # and one checkpoint copy (every verify step makes one, every rollback one more).
        "replayed_tokens_per_output_token": counts["replayed"] / total,
        "checkpoint_copy_us": copy_us,
        "same_tokens": tokens["plain"] == tokens["speculative"],
    }


def checkpoint_copy_us(llm: LLM, repeats: int = 200) -> float:
    """Microseconds one state slot copy takes on this engine (best of `repeats`): what a
    verify step's checkpoint and a rollback's restore each cost."""
    memory = llm.engine.executor.driver.memory
    assert memory is not None
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        memory.copy_slot(0, 1)
        best = min(best, time.perf_counter() - start)
    return best * 1e6


def report(row: dict[str, Any], concurrency: int) -> None:
    print(
        f"{row['workload']:26s} x{concurrency}: plain {row['plain_tok_s']:7.1f} tok/s, "
        f"speculative {row['speculative_tok_s']:7.1f} tok/s, {row['ratio']:.2f}x, "
        f"acceptance {row['acceptance_rate']:.2f}, "
        f"{row['tokens_per_verify_step']:.2f} tokens/verify, "
        f"{row['replayed_tokens_per_output_token']:.2f} replayed/token, "
        f"copy {row['checkpoint_copy_us']:.0f} us, same tokens: {row['same_tokens']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_family_arguments(parser, "speculative")
    parser.add_argument("--quick", action="store_true", help="small checkpoint, one repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="speculative_config.disable_by_batch_size (default: the engine's: on the CPU, "
        "the batch whose verify rows fit eight)",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    permutation = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        plain_folder, copying_folder = Path(scratch) / "plain", Path(scratch) / "copying"
        build_checkpoint(plain_folder, args.quick, args.family)
        copying_checkpoint(plain_folder, copying_folder, permutation)
        for concurrency in (1, 8):
            edited = copy_prompts(permutation, concurrency, True, concurrency)
            unedited = copy_prompts(permutation, concurrency, False, concurrency)
            workloads = {
                "copy (edit a file)": (copying_folder, edited),
                "copy, no edits (ceiling)": (copying_folder, unedited),
                "random": (plain_folder, random_prompts(concurrency, concurrency)),
            }
            for workload, (folder, prompts) in workloads.items():
                row = {"workload": workload} | compare(folder, prompts, args)
                rows.append(row)
                report(row, concurrency)
            if concurrency == 1:
                # The target as its own draft: every draft stands, at the price of running
                # the model k more times a step: what verification alone allows.
                row = {"workload": "random, self-draft"} | compare(
                    plain_folder, random_prompts(1, 1), args, draft=plain_folder
                )
                rows.append(row)
                report(row, concurrency)
    write_result(
        output_path(args),
        {
            "benchmark": "speculative",
            "family": args.family,
            "num_speculative_tokens": args.num_speculative_tokens,
            "disable_by_batch_size": args.disable_by_batch_size,
            "output_tokens": OUTPUT_TOKENS,
            "machine": machine(),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
