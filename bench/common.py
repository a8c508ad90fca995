"""What the benchmark scripts share: the mid-size random checkpoints (one per family), the
machine record and the JSON result file."""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.workers import LLM, SamplingParams

# The benchmark checkpoints, one per family, written with transformers so every system loads
# the same weights: random, fp32, hidden 512 and 12 layers (hidden 128 with `quick`).
FAMILIES = {
    "nemotron_h": "random NemotronH-style, hidden 512, 12 layers (M-M*-M-M*-M-), fp32",
    "qwen3_5": "random Qwen3.5-style (Gated DeltaNet), hidden 512, 12 layers (3 GDN : 1 gated "
    "attention), fp32",
}


# Qwen3.5-4B's published shape (Qwen/Qwen3.5-4B's config.json): the benchmarks that build a
# model of a real size (realistic_model.py, load_memory.py) take it from here.
QWEN3_5_4B: dict[str, Any] = dict(
    vocab_size=248320,
    hidden_size=2560,
    intermediate_size=9216,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    tie_word_embeddings=True,
)


def add_family_arguments(parser: argparse.ArgumentParser, benchmark: str) -> None:
    """`--family` (the checkpoint) and `--output` (default bench/results/<benchmark>.json, the
    family's name appended for any but NemotronH)."""
    parser.add_argument("--family", choices=sorted(FAMILIES), default="nemotron_h")
    parser.add_argument("--output", default=None, help=f"default bench/results/{benchmark}...")
    parser.set_defaults(benchmark=benchmark)


def output_path(args: argparse.Namespace) -> str:
    if args.output:
        return args.output
    suffix = "" if args.family == "nemotron_h" else f"_{args.family}"
    return f"bench/results/{args.benchmark}{suffix}.json"


def build_checkpoint(folder: Path, quick: bool, family: str = "nemotron_h") -> None:
    """The benchmark checkpoint of `family` (FAMILIES) in `folder`."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        _build_qwen3_5(folder, quick)
        return
    from transformers import NemotronHConfig, NemotronHForCausalLM

    size = (
        dict(
            hidden_size=128,
            intermediate_size=256,
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=32,
        )
        if quick
        else dict(
            hidden_size=512,
            intermediate_size=1536,
            mamba_num_heads=16,
            mamba_head_dim=64,
            ssm_state_size=64,
        )
    )
    config = NemotronHConfig(
        vocab_size=4096,
        hybrid_override_pattern="M-M*-M-M*-M-",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        n_groups=2,
        chunk_size=128,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        time_step_min=1e-6,
        max_position_embeddings=8192,
        **size,
    )
    NemotronHForCausalLM(config).save_pretrained(folder)


def _build_qwen3_5(folder: Path, quick: bool) -> None:
    """Qwen3.5's shape scaled down: 12 layers, every fourth full attention (gated, partial
    RoPE), GDN with twice as many value heads as key heads, a gated MLP after each."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    size = (
        dict(hidden_size=128, intermediate_size=384, linear_num_key_heads=2)
        if quick
        else dict(hidden_size=512, intermediate_size=1536, linear_num_key_heads=4)
    )
    config = Qwen3_5TextConfig(
        vocab_size=4096,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=2 * size["linear_num_key_heads"],
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **size,
    )
    Qwen3_5ForCausalLM(config).save_pretrained(folder)


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    output = Path(path)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


@dataclass(frozen=True)
class Workload:
    concurrency: int
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    concurrency: int,
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    seed: int,
) -> Workload:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(
        prompt_range[0], prompt_range[1] + 1, (num_requests,), generator=gen
    )
    output_lens = torch.randint(
        output_range[0], output_range[1] + 1, (num_requests,), generator=gen
    )
    prompts = [torch.randint(1, 4096, (int(n),), generator=gen).tolist() for n in prompt_lens]
    return Workload(concurrency, prompts, output_lens.tolist())


def run_ours(
    folder: Path, workload: Workload, forward_paths: tuple[str, ...] = ("native", "eager")
) -> float:
    """Seconds our engine takes for the workload (continuous batching, at most
    `concurrency` running), after a one-request warm-up (and, with the `compiled` path, after
    the engine compiled its decode step at start)."""
    llm = LLM(
        str(folder),
        max_num_seqs=workload.concurrency,
        max_num_batched_tokens=2048,
        forward_paths=forward_paths,
    )
    warmup = SamplingParams(max_tokens=workload.output_lens[0], temperature=0.0, ignore_eos=True)
    llm.generate(workload.prompts[:1], warmup, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == workload.num_output_tokens
    return elapsed


def workload_ranges(quick: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """(prompt length range, output length range) of the throughput comparisons."""
    return ((8, 32), (4, 16)) if quick else ((64, 512), (32, 256))


def comparison_workloads(quick: bool) -> list[Workload]:
    """The throughput comparisons' workloads, at 1, 8 and 32 concurrent requests: 64–512-token
    prompts and 32–256-token outputs (quick: 8–32 and 4–16, one request per slot)."""
    prompt_range, output_range = workload_ranges(quick)
    workloads = []
    for concurrency in (1, 8, 32):
        num_requests = concurrency if quick else (4 if concurrency == 1 else 2 * concurrency)
        workloads.append(
            make_workload(concurrency, num_requests, prompt_range, output_range, seed=concurrency)
        )
    return workloads


def gemm_floor_ms(llm: LLM, batch_size: int, repeats: int = 20) -> float:
    """The decode step's floor for `batch_size` rows, measured here: every weight matrix of
    the model (each linear layer and the LM head) multiplied once, nothing else. Median of
    `repeats` passes, in ms. A decode step streams each weight once, so it cannot be faster
    than this. Up to `GEMV_ROWS` rows on the CPU the matrices go through the C mat-vec one
    after another in one parallel region (`gemv_each_f32`), as the native step runs them: a
    call per matrix would add ~10 us of dispatch and a team wake-up each, which the native
    step does not pay. Otherwise each goes through the engine's own call (pre-packed where
    the engine packs)."""
    from hybridserve.kernels.cpu.gemm import GEMV_ROWS
    from hybridserve.kernels.dispatch import cpu_kernel
    from hybridserve.workers.layers.linear import PackableLinear, packed_matmul

    model = llm.engine.executor.driver.model
    weights = [(m.weight, m.is_packed) for m in model.modules() if isinstance(m, PackableLinear)]
    weights.append((model.lm_head_weight, model.lm_head_is_packed))
    inputs = [
        torch.randn(batch_size, w.shape[1], dtype=w.dtype, device=w.device) for w, _ in weights
    ]
    plain = [w for w, _ in weights]
    gemv_each = cpu_kernel("gemv_each")
    one_region = batch_size <= GEMV_ROWS and all(
        w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in plain
    )
    outputs = [torch.empty(batch_size, w.shape[0]) for w in plain] if one_region else []
    multiply = gemv_each(plain, inputs, outputs) if one_region and gemv_each else None
    if multiply is None:

        def multiply() -> None:
            for (weight, is_packed), x in zip(weights, inputs, strict=True):
                packed_matmul(x, weight, None, is_packed)

    sync = torch.cuda.synchronize if weights[0][0].is_cuda else lambda: None
    totals = []
    with torch.inference_mode():
        for _ in range(repeats + 2):
            sync()
            start = time.perf_counter()
            multiply()
            sync()
            totals.append(time.perf_counter() - start)
    totals = sorted(totals[2:])  # the first two warm the caches
    return totals[len(totals) // 2] * 1e3
