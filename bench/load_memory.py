"""Host memory while loading a 4B-shaped FP8 checkpoint: no float copy, no resident shards.

    python bench/load_memory.py [--quick] [--output ...]

Writes a Qwen3.5-4B-shaped checkpoint (transformers' Qwen3.5 text model at hidden 2560, 32
layers, MLP 9216, 248k vocabulary: 4.2B parameters), random, block-FP8 (128 x 128) in every
projection and bfloat16 elsewhere, in ~1 GiB shards as HF writes them; then loads it in a
fresh process with the weights kept FP8 (the default) and reports the largest the process's
resident memory grew (VmHWM after resetting it) and its anonymous part at its largest (sampled
every 5 ms), against the model's own bytes and the largest shard. The bound the loader keeps:
model + largest shard; no weight passes through a float32 copy of the model. `--quick` builds a
4-layer, 32k-vocabulary version of the same shape.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybridserve.bench.common import QWEN3_5_4B, machine, write_result

BLOCK = 128
SHARD_BYTES = 1 << 30


def build(folder: Path, quick: bool) -> None:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    shape = QWEN3_5_4B | ({"vocab_size": 32768, "num_hidden_layers": 4} if quick else {})
    config = Qwen3_5TextConfig(max_position_embeddings=8192, torch_dtype="bfloat16", **shape)
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in Qwen3_5ForCausalLM(config).named_parameters()}
    folder.mkdir()
    raw = config.to_dict() | {
        "quantization_config": {
            "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK],
        }
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw))
    gen = torch.Generator().manual_seed(0)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    shard: dict[str, torch.Tensor] = {}
    written = [0]

    def flush() -> None:
        if shard:
            name = f"model-{written[0] + 1:05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            shard.clear()
            written[0] += 1

    for name, shape in shapes.items():
        if len(shape) == 2 and "proj" in name and shape[0] >= BLOCK:
            picks = torch.randint(0, len(finite), shape, generator=gen)
            shard[name] = finite[picks].view(torch.float8_e4m3fn)
            grid = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            shard[name.removesuffix("weight") + "weight_scale_inv"] = torch.rand(grid) / 448
        else:
            shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES:
            flush()
    flush()


PROBE = """
import json, sys, threading, time
import torch
from hybridserve.workers.models.loader import load_model, open_checkpoint
def status(field):
    line = next(l for l in open("/proc/self/status") if l.startswith(field))
    return int(line.split()[1]) * 1024
checkpoint = open_checkpoint(sys.argv[1])
peak_anon, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status("RssAnon:"))
        time.sleep(0.005)
open("/proc/self/clear_refs", "w").write("5")
rss, anon = status("VmRSS:"), status("RssAnon:")
sampler = threading.Thread(target=sample)
sampler.start()
model = load_model(checkpoint, dtype=torch.float32, device="cpu", keep_fp8=True)
done.set()
sampler.join()
print(json.dumps({
    "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    "fp8_bytes": sum(p.nbytes for p in model.parameters() if p.dtype == torch.float8_e4m3fn),
    "peak_rss_growth": status("VmHWM:") - rss,
    "peak_anon_growth": peak_anon[0] - anon,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 layers, a 32k vocabulary")
    parser.add_argument("--output", default="bench/results/load_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3_5-4b-fp8"
        build(folder, args.quick)
        sizes = [f.stat().st_size for f in folder.glob("*.safetensors")]
        out = subprocess.run(
            [sys.executable, "-c", PROBE, str(folder)], check=True, capture_output=True, text=True
        ).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result |= {
        "checkpoint_bytes": sum(sizes),
        "largest_shard_bytes": max(sizes),
        "num_shards": len(sizes),
    }
    bound = result["model_bytes"] + result["largest_shard_bytes"]
    gib = 2**30
    for key in ("checkpoint_bytes", "largest_shard_bytes", "model_bytes", "fp8_bytes",
                "peak_rss_growth", "peak_anon_growth"):  # fmt: skip
        print(f"{key:22} {result[key] / gib:7.2f} GiB")
    print(f"{'bound (model + shard)':22} {bound / gib:7.2f} GiB: peak is "
          f"{result['peak_rss_growth'] / bound:.2f} of it")  # fmt: skip
    write_result(args.output, {"benchmark": "load_memory", "quick": args.quick,
                               "machine": machine(), **result, "bound_bytes": bound})  # fmt: skip


if __name__ == "__main__":
    main()
