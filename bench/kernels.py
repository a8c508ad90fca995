"""Triton kernels against their torch references and against the roofline, on one GPU.

    python bench/kernels.py [--output bench/results/kernels.json] [--repeats 20]

For each kernel at a serving-sized shape (bf16 activations, fp32 SSM state): the Triton time,
the torch reference's time on the same GPU, and the roofline = max(bytes moved / measured copy
bandwidth, FLOPs / measured bf16 matmul rate), both ceilings measured in this run. Without a GPU
it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridserve.kernels import reference
from hybridserve.kernels.dispatch import KERNELS, implementation


@dataclass
class Case:
    name: str
    kernel: str  # public kernel name
    make: Callable[[], tuple[tuple, dict]]
    bytes_moved: int
    flops: int


def cuda_time(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds per call, CUDA-event timed after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def ceilings(repeats: int) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s)."""
    big = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    out = torch.empty_like(big)
    copy_s = cuda_time(lambda: out.copy_(big), repeats)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = cuda_time(lambda: a @ b, repeats)
    return 2 * big.numel() * 4 / copy_s, 2 * 8192**3 / mm_s


def cases() -> list[Case]:
    dev, bf16, f32 = "cuda", torch.bfloat16, torch.float32
    out: list[Case] = []

    # Mamba2 prefill: 4 sequences x 2048 tokens, 64 heads x 64 x 128 state, 8 groups.
    T, S, H, P, N, G, Q = 8192, 4, 64, 64, 128, 8, 128

    def ssd() -> tuple[tuple, dict]:
        pool = torch.zeros(S, H, P, N, dtype=f32, device=dev)
        slots = torch.arange(S, device=dev)
        args = (
            torch.randn(T, H, P, dtype=bf16, device=dev),
            torch.randn(T, H, dtype=bf16, device=dev),
            -torch.rand(H, device=dev) * 4,
            torch.randn(T, G, N, dtype=bf16, device=dev),
            torch.randn(T, G, N, dtype=bf16, device=dev),
        )
        return args, dict(
            chunk_size=Q,
            cu_seqlens=torch.arange(0, T + 1, T // S, device=dev),
            ssm_states=pool,
            initial_state_slots=slots,
            final_state_slots=slots,
            D=torch.ones(H, device=dev),
            dt_bias=torch.zeros(H, device=dev),
        )

    ssd_bytes = 2 * (2 * T * H * P + T * H + 2 * T * G * N) + 2 * 4 * S * H * P * N
    ssd_flops = 2 * T * H * (Q * N + Q * P + 2 * P * N)
    out.append(Case("ssd prefill 4x2048", "mamba_chunk_scan", ssd, ssd_bytes, ssd_flops))

    # Decode state update: 256 rows.
    R = 256

    def state_update() -> tuple[tuple, dict]:
        pool = torch.randn(R, H, P, N, dtype=f32, device=dev)
        args = (
            pool,
            torch.randn(R, H, P, dtype=bf16, device=dev),
            torch.randn(R, H, dtype=bf16, device=dev),
            -torch.rand(H, device=dev),
            torch.randn(R, G, N, dtype=bf16, device=dev),
            torch.randn(R, G, N, dtype=bf16, device=dev),
        )
        return args, dict(
            state_slots=torch.arange(R, device=dev),
            D=torch.ones(H, device=dev),
            dt_bias=torch.zeros(H, device=dev),
        )

    out.append(
        Case(
            "state update x256",
            "selective_state_update",
            state_update,
            2 * 4 * R * H * P * N + 2 * 2 * R * H * P,
            4 * R * H * P * N,
        )
    )

    # Causal conv over the x|B|C channels.
    C, W = H * P + 2 * G * N, 4

    def conv() -> tuple[tuple, dict]:
        states = torch.zeros(S, C, W - 1, dtype=bf16, device=dev)
        slots = torch.arange(S, device=dev)
        return (
            (
                torch.randn(T, C, dtype=bf16, device=dev),
                torch.randn(C, W, dtype=bf16, device=dev),
                torch.randn(C, dtype=bf16, device=dev),
            ),
            dict(
                cu_seqlens=torch.arange(0, T + 1, T // S, device=dev),
                conv_states=states,
                initial_state_slots=slots,
                final_state_slots=slots,
            ),
        )

    out.append(Case("conv1d prefill 4x2048", "causal_conv1d", conv, 2 * 2 * T * C, 2 * T * C * W))

    def conv_update() -> tuple[tuple, dict]:
        states = torch.zeros(R, C, W - 1, dtype=bf16, device=dev)
        return (
            (
                torch.randn(R, C, dtype=bf16, device=dev),
                torch.randn(C, W, dtype=bf16, device=dev),
                torch.randn(C, dtype=bf16, device=dev),
            ),
            dict(conv_states=states, state_slots=torch.arange(R, device=dev)),
        )

    out.append(
        Case(
            "conv1d update x256",
            "causal_conv1d_update",
            conv_update,
            2 * (2 * R * C + 2 * R * C * (W - 1)),
            2 * R * C * W,
        )
    )

    # Paged attention: 32 query heads, 8 kv heads, head dim 128, 16-token blocks.
    AH, KH, D, BS = 32, 8, 128, 16

    def kv_pool(num_blocks: int) -> torch.Tensor:
        return torch.randn(num_blocks, 1, 2, KH, BS, D, dtype=bf16, device=dev)

    ctx, new = 4096, 2048  # 4 sequences: a 2048-token cached prefix + 2048 new tokens each

    def prefill() -> tuple[tuple, dict]:
        per_seq = ctx // BS
        pool = kv_pool(S * per_seq)
        tables = torch.randperm(S * per_seq, device=dev).view(S, per_seq).int()
        return (
            (torch.randn(S * new, AH, D, dtype=bf16, device=dev), pool[:, 0, 0], pool[:, 0, 1]),
            dict(
                block_tables=tables,
                cu_seqlens_q=torch.arange(0, S * new + 1, new, device=dev),
                seq_lens=torch.full((S,), ctx, device=dev),
                scale=D**-0.5,
            ),
        )

    prefill_flops = S * 4 * AH * D * (new * (ctx - new) + new * new // 2)
    out.append(
        Case(
            "attention prefill 4x(2048+2048)",
            "paged_attention_prefill",
            prefill,
            2 * (2 * S * ctx * KH * D + 2 * S * new * AH * D),
            prefill_flops,
        )
    )

    def decode() -> tuple[tuple, dict]:
        per_row = ctx // BS
        pool = kv_pool(R * per_row)
        tables = torch.randperm(R * per_row, device=dev).view(R, per_row).int()
        return (
            (torch.randn(R, AH, D, dtype=bf16, device=dev), pool[:, 0, 0], pool[:, 0, 1]),
            dict(block_tables=tables, seq_lens=torch.full((R,), ctx, device=dev), scale=D**-0.5),
        )

    out.append(
        Case(
            "attention decode 256x4096",
            "paged_attention_decode",
            decode,
            2 * 2 * R * ctx * KH * D,
            4 * R * AH * ctx * D,
        )
    )

    def store() -> tuple[tuple, dict]:
        pool = kv_pool(T // BS)
        return (
            (
                torch.randn(T, KH, D, dtype=bf16, device=dev),
                torch.randn(T, KH, D, dtype=bf16, device=dev),
                pool[:, 0, 0],
                pool[:, 0, 1],
                torch.randperm(T, device=dev),
            ),
            {},
        )

    out.append(Case("store_kv 8192 tokens", "store_kv", store, 2 * 2 * 2 * T * KH * D, 0))

    hidden, group = H * P, H * P // G

    def norm() -> tuple[tuple, dict]:
        return (
            (
                torch.randn(T, hidden, dtype=bf16, device=dev),
                torch.randn(T, hidden, dtype=bf16, device=dev),
                torch.ones(hidden, dtype=bf16, device=dev),
            ),
            dict(group_size=group, eps=1e-5),
        )

    out.append(
        Case("gated rmsnorm 8192 rows", "gated_rms_norm", norm, 3 * 2 * T * hidden, 8 * T * hidden)
    )
    assert {c.kernel for c in out} == {name for name, k in KERNELS.items() if k.triton}
    return out


def measure(case: Case, repeats: int, bandwidth: float, matmul_rate: float) -> dict[str, Any]:
    triton_fn = implementation(case.kernel, "triton")
    reference_fn = getattr(reference, f"{case.kernel}_ref")
    triton_args, triton_kwargs = case.make()
    triton_s = cuda_time(lambda: triton_fn(*triton_args, **triton_kwargs), repeats)
    ref_args, ref_kwargs = case.make()  # fresh state pools for the reference
    reference_s = cuda_time(lambda: reference_fn(*ref_args, **ref_kwargs), max(3, repeats // 4))
    roofline_s = max(case.bytes_moved / bandwidth, case.flops / matmul_rate)
    return {
        "kernel": case.name,
        "triton_ms": triton_s * 1e3,
        "reference_ms": reference_s * 1e3,
        "speedup": reference_s / triton_s,
        "roofline_ms": roofline_s * 1e3,
        "fraction_of_roofline": roofline_s / triton_s,
        "bytes": case.bytes_moved,
        "flops": case.flops,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="bench/results/kernels.json")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "bench/kernels.py: no CUDA device here; the kernel benchmark needs a GPU "
            "(the CPU path is the torch reference itself). Nothing measured."
        )
        return 0

    bandwidth, matmul_rate = ceilings(args.repeats)
    rows = []
    print(
        f"device: {torch.cuda.get_device_name()}; copy {bandwidth / 1e12:.2f} TB/s, "
        f"bf16 matmul {matmul_rate / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'kernel':<34} {'triton ms':>9} {'torch ms':>9} {'speedup':>8} {'roofline ms':>11} "
        f"{'of roofline':>11}"
    )
    for case in cases():
        row = measure(case, args.repeats, bandwidth, matmul_rate)
        rows.append(row)
        print(
            f"{case.name:<34} {row['triton_ms']:>9.3f} {row['reference_ms']:>9.3f} "
            f"{row['speedup']:>7.1f}x {row['roofline_ms']:>11.3f} "
            f"{row['fraction_of_roofline']:>10.0%}"
        )
        torch.cuda.empty_cache()
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(
        json.dumps(
            {
                "benchmark": "kernels",
                "device": torch.cuda.get_device_name(),
                "copy_bytes_per_s": bandwidth,
                "matmul_flops_per_s": matmul_rate,
                "kernels": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
