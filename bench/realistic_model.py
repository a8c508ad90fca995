"""A model of realistic size, measured against the hardware's limits: Nemotron-H-8B- and
Qwen3.5-4B-shaped models built on the device from their published shapes, with random weights
(`load_format="dummy"`, vLLM's: nothing to download).

    python bench/realistic_model.py [--models nemotron_h_8b qwen3_5_4b] [--device cuda]
        [--dtype bfloat16] [--running 1 8 64 256] [--prefill-len 8192] [--quick]
        [--output bench/results/realistic_model.json]

Per model, one engine (prefix caching and turn-end snapshots on, as a decode engine serves):
- decode: N requests with 128-token prompts decode together; output tokens/s over
  `DECODE_STEPS` decode steps (every request's first token excluded), at each N;
- prefill: one `--prefill-len`-token prompt and one output token: prompt tokens/s, best of 2;
- multi-turn TTFT: a conversation of `TURNS` turns (a 2,048-token first prompt, then 256 new
  tokens a turn, 64 output tokens each), the time to each turn's first token with reuse (the
  turn resumes from the last one's turn-end snapshot) and without (the cache cleared first);
- the limits, measured in the same run: memory bandwidth (a 1 GiB device copy; 64 MiB on
  the CPU) and the matmul rate (an 8192-cube GEMM in the run's dtype; 1024 on the CPU).
  Decode at one request cannot beat the weight bytes it reads over that bandwidth; prefill
  cannot beat its FLOPs (2 x parameters x tokens, plus causal attention's 2 x heads x
  head_dim x tokens^2 per attention layer; the scans' FLOPs are left out, a few percent)
  over that rate. Each is reported as a share of its limit.

Shapes: Nemotron-H-8B-Base-8K (52 layers, `M-M-M-M*-` pattern with 4 attention layers,
hidden 4096, FFN 21504 relu2, 32 heads / 8 KV of 128, Mamba2 128 heads of 64, state 128,
8 groups, vocabulary 131072); Qwen3.5-4B (32 layers, every fourth gated attention, hidden
2560, FFN 9216, 16 heads / 4 KV of 256, Gated DeltaNet 16 key / 32 value heads of 128,
vocabulary 248320, tied embeddings; the linear-attention head counts are the family's
defaults). `--quick` scales both down for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import QWEN3_5_4B, machine, write_result
from hybridserve.workers import LLM, SamplingParams

DECODE_PROMPT, DECODE_STEPS = 128, 32
TURNS, FIRST_TURN, TURN_TOKENS, TURN_OUTPUT = 4, 2048, 256, 64
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def write_nemotron_h_8b(folder: Path, quick: bool) -> None:
    from transformers import NemotronHConfig

    shape: dict[str, Any] = dict(
        vocab_size=131072,
        hidden_size=4096,
        num_hidden_layers=52,
        hybrid_override_pattern=NEMOTRON_H_8B_PATTERN,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        mamba_num_heads=128,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
    )
    if quick:
        shape.update(
            vocab_size=4096,
            hidden_size=256,
            num_hidden_layers=10,
            hybrid_override_pattern="M-M*-M-M*-",
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            mamba_num_heads=8,
            mamba_head_dim=32,
            ssm_state_size=32,
            n_groups=2,
        )
    NemotronHConfig(
        conv_kernel=4,
        chunk_size=128,
        mlp_hidden_act="relu2",
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **shape,
    ).save_pretrained(folder)


def write_qwen3_5_4b(folder: Path, quick: bool) -> None:
    from transformers import Qwen3_5TextConfig

    shape = dict(QWEN3_5_4B)
    if quick:
        shape.update(
            vocab_size=4096,
            hidden_size=256,
            num_hidden_layers=8,
            intermediate_size=512,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        )
    Qwen3_5TextConfig(
        max_position_embeddings=262144, torch_dtype="bfloat16", **shape
    ).save_pretrained(folder)


MODELS: dict[str, Callable[[Path, bool], None]] = {
    "nemotron_h_8b": write_nemotron_h_8b,
    "qwen3_5_4b": write_qwen3_5_4b,
}


def timed(device: torch.device, work: Callable[[], Any], repeats: int = 5) -> float:
    """Best seconds of `repeats` runs of `work` (after one warm-up), synchronised."""
    work()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def hardware_limits(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Copy bandwidth (bytes/s, read + write) and matmul rate (FLOP/s), measured here."""
    on_gpu = device.type == "cuda"
    size = (1 << 30) if on_gpu else (64 << 20)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    bandwidth = 2 * size / timed(device, lambda: target.copy_(source))
    n = 8192 if on_gpu else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    rate = 2 * n**3 / timed(device, lambda: a @ b)
    return {"copy_bytes_per_s": bandwidth, "matmul_flops_per_s": rate}


def model_costs(llm: LLM) -> dict[str, float]:
    """What one decode step must read (every weight but the input embedding's unused rows),
    and per token of a prompt the weights' FLOPs and per token pair the attention's."""
    model = llm.engine.executor.driver.model
    config = llm.engine.model_config
    embedding = model.embed.weight
    seen: set[int] = set()
    weight_bytes = params = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param is embedding and not config.tie_word_embeddings:
            continue  # a decode step reads one row of it
        weight_bytes += param.numel() * param.element_size()
        params += param.numel()
    attention = config.attention
    attention_flops = 0.0
    if attention is not None:
        attention_flops = 2.0 * attention.num_heads * attention.head_dim
        attention_flops *= config.num_attention_layers
    return {
        "weight_bytes": float(weight_bytes),
        "flops_per_token": 2.0 * params,
        "attention_flops_per_token_pair": attention_flops,
    }


def decode(llm: LLM, num_running: int, vocab: int) -> float:
    """Output tokens/s of `num_running` requests decoding together."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(num_running)
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0.0, ignore_eos=True)
    for _ in range(num_running):
        prompt = torch.randint(1, vocab, (DECODE_PROMPT,), generator=gen).tolist()
        engine.add_request(prompt, params)
    while len(engine.scheduler.running) < num_running or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return num_running * DECODE_STEPS / elapsed


def time_to_first_token(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds to the prompt's first token, and its output tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    first = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.token_ids and first is None:
                first = time.perf_counter() - start
            if output.request_id == request_id and output.finished:
                tokens = output.token_ids
    assert first is not None
    return first, tokens


def multiturn(llm: LLM, vocab: int, reuse: bool) -> list[float]:
    """Each turn's TTFT in one conversation, resuming from the last turn's snapshot or not."""
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, vocab, (FIRST_TURN,), generator=gen).tolist()
    ttfts = []
    for _ in range(TURNS):
        if not reuse:
            llm.engine.clear_cache()
        ttft, output = time_to_first_token(llm, prompt, TURN_OUTPUT)
        ttfts.append(ttft)
        prompt = prompt + output + torch.randint(1, vocab, (TURN_TOKENS,), generator=gen).tolist()
    return ttfts


def measure(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    most = max(args.running)
    longest = max(args.prefill_len, FIRST_TURN + TURNS * (TURN_TOKENS + TURN_OUTPUT)) + 64
    engine_args: dict[str, Any] = dict(
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=most,
        max_model_len=longest,
        max_num_batched_tokens=max(args.prefill_len, 2048),
        snapshot_turn_end=True,
    )
    if args.device == "cpu":
        engine_args["num_kv_blocks"] = most * 16 + 2 * (longest // 16 + 1)
    with LLM(str(folder), **engine_args) as llm:
        vocab = llm.engine.model_config.vocab_size
        device = llm.engine.executor.driver.device
        limits = hardware_limits(device, llm.engine.executor.driver.dtype)
        costs = model_costs(llm)
        decode_floor = limits["copy_bytes_per_s"] / costs["weight_bytes"]  # tokens/s at N = 1
        decode(llm, min(2, most), vocab)  # warm-up (and, on CUDA, the first graphs' replays)
        decodes = [{"running": n, "tokens_per_s": decode(llm, n, vocab)} for n in args.running]
        for row in decodes:
            row["share_of_bandwidth_limit"] = row["tokens_per_s"] / (row["running"] * decode_floor)
        gen = torch.Generator().manual_seed(1)
        prefill_seconds = min(
            time_to_first_token(
                llm, torch.randint(1, vocab, (args.prefill_len,), generator=gen).tolist(), 1
            )[0]
            for _ in range(2)
        )
        tokens = args.prefill_len
        flops = costs["flops_per_token"] * tokens
        flops += costs["attention_flops_per_token_pair"] * tokens * tokens
        prefill_floor = flops / limits["matmul_flops_per_s"]
        with_reuse = multiturn(llm, vocab, reuse=True)
        without = multiturn(llm, vocab, reuse=False)
    return {
        "model": name,
        "weight_gb": costs["weight_bytes"] / 1e9,
        "limits": limits,
        "decode": decodes,
        "decode_limit_tokens_per_s_at_1": decode_floor,
        "prefill_tokens": tokens,
        "prefill_tokens_per_s": tokens / prefill_seconds,
        "prefill_share_of_compute_limit": prefill_floor / prefill_seconds,
        "multiturn_ttft_s": {"with_reuse": with_reuse, "without_reuse": without},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--running", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="the shapes scaled down")
    parser.add_argument("--output", default="bench/results/realistic_model.json")
    args = parser.parse_args()
    results = []
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            MODELS[name](Path(tmp), args.quick)
            results.append(measure(name, Path(tmp), args))
    for r in results:
        limits = r["limits"]
        print(
            f"{r['model']}: {r['weight_gb']:.2f} GB of weights; copy "
            f"{limits['copy_bytes_per_s'] / 1e9:.0f} GB/s, matmul "
            f"{limits['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s"
        )
        for row in r["decode"]:
            print(
                f"  decode at {row['running']:>4}: {row['tokens_per_s']:>9.1f} tok/s "
                f"({row['share_of_bandwidth_limit']:.0%} of the weight-bandwidth limit)"
            )
        print(
            f"  prefill {r['prefill_tokens']} tokens: {r['prefill_tokens_per_s']:.0f} tok/s "
            f"({r['prefill_share_of_compute_limit']:.0%} of the compute limit)"
        )
        ttft = r["multiturn_ttft_s"]
        print(
            "  multi-turn TTFT with reuse "
            + " ".join(f"{t * 1e3:.0f}" for t in ttft["with_reuse"])
            + " ms; without "
            + " ".join(f"{t * 1e3:.0f}" for t in ttft["without_reuse"])
            + " ms"
        )
    write_result(
        args.output,
        {
            "machine": machine(),
            "device": args.device,
            "dtype": args.dtype,
            "quick": args.quick,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
