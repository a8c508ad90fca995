"""FP8 weights against float weights on one machine: memory and speed, side by side.

    python bench/fp8_weights.py [--family qwen3_5|nemotron_h] [--quick] [--repeats 3]
                                [--device cpu|cuda] [--dtype float32|bfloat16]

The family's mid-size random checkpoint (bench/common.py, fp32) is quantized block-wise
(`quant_method: fp8`, 128 x 128 blocks, as Qwen3.5's FP8 checkpoints are), and three engines
run the same work:

- float: the float32 checkpoint (in `--dtype`);
- fp8 keep: the FP8 checkpoint with its weights held FP8 (each GEMM dequantises as it reads:
  the native decode step and the C mat-vec decode the bytes in registers up to eight rows;
  prompt chunks multiply dequantised pieces of each weight);
- fp8 dequantize: the FP8 checkpoint dequantised to float32 at load.

Per engine: the bytes of its weights; the peak host memory its load adds (in a fresh
process: the largest RSS during `load_model` minus before it, against the shard's size plus
the model's own); prefill tokens/s and decode output tokens/s for 1 and 8 concurrent requests,
each with a fresh 2k-token prompt (no reuse). The engines alternate, each keeps its best of
`--repeats`. Ratios are against float.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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
from hybridserve.workers import Engine, EngineConfig, SamplingParams

BLOCK = 128
E4M3_MAX = 448.0
ENGINES = {
    "float": ("float", "dequantize"),
    "fp8 keep": ("fp8", "keep"),
    "fp8 dequantize": ("fp8", "dequantize"),
}


def quantize_checkpoint(source: Path, target: Path) -> None:
    """`source`'s projections and experts block-FP8, everything else as it is."""
    fp8: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if not (tensor.dim() == 2 and "proj" in name and "conv" not in name):
            fp8[name] = tensor
            continue
        rows, cols = tensor.shape
        grid = (-(-rows // BLOCK), -(-cols // BLOCK))
        padded = torch.zeros(grid[0] * BLOCK, grid[1] * BLOCK)
        padded[:rows, :cols] = tensor
        blocks = padded.view(grid[0], BLOCK, grid[1], BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX
        per_element = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
        fp8[name] = (tensor / per_element[:rows, :cols]).to(torch.float8_e4m3fn)
        fp8[name.removesuffix("weight") + "weight_scale_inv"] = scale
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    quantization = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    (target / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    save_file(fp8, str(target / "model.safetensors"), metadata={"format": "pt"})


# Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS.
LOAD_PROBE = """
import gc, json, sys
import torch
from hybridserve.workers.models.loader import load_model, open_checkpoint
def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1]) * 1024
def load():
    checkpoint = open_checkpoint(sys.argv[1])
    return load_model(checkpoint, dtype=torch.float32, device="cpu", keep_fp8=sys.argv[2] == "keep")
load()  # the first load pages in code and thread pools that stay: measure the second
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS:")
model = load()
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"load_peak_bytes": status("VmHWM:") - before, "weight_bytes": weights}))
"""


def load_memory(folder: Path, fp8_weights: str) -> dict[str, int]:
    """The weights' bytes and the peak RSS `load_model` adds, in a fresh process (a process's
    peak only grows: measuring in this one would see earlier engines' peaks)."""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PROBE, str(folder), fp8_weights],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s: the prompts' tokens over the time until every request has its first
    token; decode tokens/s: the tokens generated after that over the time they took)."""
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    generated: dict[str, int] = {}
    prefilled_at, tokens_then = 0.0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated[output.request_id] = len(output.token_ids)
        if not prefilled_at and len(generated) == len(prompts) and all(generated.values()):
            prefilled_at, tokens_then = time.perf_counter(), sum(generated.values())
    decode_seconds = time.perf_counter() - prefilled_at
    prefill = sum(map(len, prompts)) / (prefilled_at - start)
    return prefill, (sum(generated.values()) - tokens_then) / decode_seconds


def run_engine(
    folder: Path, fp8_weights: str, args: argparse.Namespace, prompt_len: int, new_tokens: int,
    seed: int,
) -> dict[str, float]:  # fmt: skip
    """Prefill tokens/s and decode tokens/s at 1 and 8 requests, fresh prompts each time."""
    gen = torch.Generator().manual_seed(seed)

    def fresh(n: int) -> list[list[int]]:
        return [torch.randint(1, 4096, (prompt_len,), generator=gen).tolist() for _ in range(n)]

    engine = Engine(
        EngineConfig(
            model=str(folder), fp8_weights=fp8_weights, device=args.device, dtype=args.dtype,
            enable_prefix_caching=False, max_num_seqs=8, max_num_batched_tokens=2048,
            max_model_len=prompt_len + new_tokens + 8,
        )
    )  # fmt: skip
    try:
        measure(engine, fresh(1), 4)  # warm-up
        result = {}
        for n in (1, 8):
            prefill, decode = measure(engine, fresh(n), new_tokens)
            result[f"prefill_tok_s@{n}"], result[f"decode_tok_s@{n}"] = prefill, decode
        return result
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_family_arguments(parser, "fp8_weights")
    parser.set_defaults(family="qwen3_5")
    parser.add_argument("--quick", action="store_true", help="a small checkpoint and prompts")
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine; best is kept")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    prompt_len, new_tokens = (256, 16) if args.quick else (2048, 128)

    with tempfile.TemporaryDirectory() as tmp:
        folders = {"float": Path(tmp) / "float", "fp8": Path(tmp) / "fp8"}
        build_checkpoint(folders["float"], args.quick, args.family)
        quantize_checkpoint(folders["float"], folders["fp8"])
        shard_bytes = {k: (f / "model.safetensors").stat().st_size for k, f in folders.items()}
        rows: dict[str, dict[str, Any]] = {}
        for name, (kind, mode) in ENGINES.items():
            rows[name] = load_memory(folders[kind], mode) | {"shard_bytes": shard_bytes[kind]}
        best: dict[str, dict[str, float]] = {name: {} for name in ENGINES}
        for round_ in range(args.repeats):
            for name, (kind, mode) in ENGINES.items():  # alternating
                got = run_engine(folders[kind], mode, args, prompt_len, new_tokens, seed=round_)
                for key, value in got.items():
                    best[name][key] = max(best[name].get(key, 0.0), value)
    for name in ENGINES:
        rows[name] |= best[name]

    metrics = ["weight_bytes", "load_peak_bytes", "shard_bytes", *best["float"]]
    print(f"{'':16}" + "".join(f"{m:>18}" for m in metrics))
    for name, row in rows.items():
        cells = []
        for metric in metrics:
            value, base = row[metric], rows["float"][metric]
            shown = f"{value / 2**20:.1f} MiB" if metric.endswith("bytes") else f"{value:.1f}"
            cells.append(f"{shown} ({value / base:.2f}x)" if name != "float" else shown)
        print(f"{name:16}" + "".join(f"{c:>18}" for c in cells))
    write_result(
        output_path(args),
        {
            "benchmark": "fp8_weights",
            "family": args.family,
            "machine": machine(),
            "device": args.device,
            "dtype": args.dtype,
            "prompt_len": prompt_len,
            "new_tokens": new_tokens,
            "repeats": args.repeats,
            "engines": rows,
            "ratios_vs_float": {
                name: {m: row[m] / rows["float"][m] for m in metrics} for name, row in rows.items()
            },
        },
    )


if __name__ == "__main__":
    main()
