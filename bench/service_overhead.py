"""What serving costs on top of the engine: the same prompts offline and through the service,
colocated and 1 prefill + 1 decode, side by side in one run.

    python bench/service_overhead.py [--quick] [--output bench/results/service_overhead.json]

On the benchmark's random NemotronH checkpoint (bench/common.py; --quick: the small one):
- latency: one request at a time, a 90-token prompt and 64 output tokens, `--rounds` times
  (fresh prompts): median time to first token and median inter-token latency;
- throughput: 32 concurrent requests (128-token prompts, 64 output tokens): output tokens/s.
Offline is `Engine.step` driven in this process (a token counts when its step returns it).
The service runs on a local Ray cluster (`hybridserve serve`'s application), measured through
the official `openai` client streaming completions (a token counts when its chunk arrives).
Ratios are service / offline. The service runs once per `--torch-threads` value (CPU threads
per engine; default 1 and 2): offline, the engine has the machine to itself, while a served
engine shares it with the HTTP path (proxy, ingress, the client), and on a small machine an
engine that takes every core slows that path more than it gains.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import build_checkpoint, machine, write_result

from hybridserve.cluster import local
from hybridserve.workers import LLM, SamplingParams

LATENCY_PROMPT, LATENCY_OUTPUT = 90, 64
BATCH, BATCH_PROMPT, BATCH_OUTPUT = 32, 128, 64
ENGINE = {"max_num_seqs": BATCH, "max_model_len": 1024, "max_num_batched_tokens": 2048}
SHAPES = {
    "colocated": {"num_prefill": 0, "num_decode": 1},
    "1P1D": {"num_prefill": 1, "num_decode": 1},
}


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    output_len: int


def prompts(count: int, length: int, output: int, seed: int) -> list[Prompt]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Prompt(torch.randint(1, 4096, (length,), generator=gen).tolist(), output)
        for _ in range(count)
    ]


class TokenClock:
    """When one request's tokens arrive: the time to the first, then the gaps between."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.gaps: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now


def offline(folder: Path, latency: list[Prompt], batch: list[Prompt]) -> dict[str, float]:
    with LLM(str(folder), **ENGINE) as llm:
        engine = llm.engine
        ttfts, itls = [], []
        for prompt in [latency[0], *latency]:  # the first warms up
            params = SamplingParams(max_tokens=prompt.output_len, temperature=0.0, ignore_eos=True)
            clock = TokenClock()
            engine.add_request(prompt.token_ids, params)
            while engine.has_unfinished_requests():
                for _ in engine.step():
                    clock.tick()
            ttfts.append(clock.first)
            itls.extend(clock.gaps)
        ttfts, itls = ttfts[1:], itls[LATENCY_OUTPUT - 1 :]
        start = time.perf_counter()
        outputs = llm.generate(
            [p.token_ids for p in batch],
            SamplingParams(max_tokens=BATCH_OUTPUT, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == BATCH * BATCH_OUTPUT
    return {
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "itl_ms": statistics.median(itls) * 1e3,
        "output_tokens_per_s": BATCH * BATCH_OUTPUT / elapsed,
    }


async def stream(client: Any, model: str, prompt: Prompt) -> tuple[float, list[float]]:
    """One streamed completion: (time to first token, inter-token gaps), in seconds. The
    checkpoint has no tokenizer: chunks are counted by their token ids."""
    clock, received = TokenClock(), 0
    chunks = await client.completions.create(
        model=model,
        prompt=prompt.token_ids,
        max_tokens=prompt.output_len,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    async for chunk in chunks:
        token_ids = chunk.choices[0].model_extra.get("token_ids") if chunk.choices else None
        if not token_ids:
            continue
        clock.tick()
        received += len(token_ids)
    assert clock.first is not None and received == prompt.output_len, (
        received,
        prompt.output_len,
    )
    return clock.first, clock.gaps


def served(
    folder: Path,
    shape: dict[str, int],
    torch_threads: int,
    latency: list[Prompt],
    batch: list[Prompt],
) -> dict[str, float]:
    import openai

    model = "bench"
    config = shape | {
        "model": str(folder),
        "served_model_name": model,
        "engine": ENGINE,
        "torch_threads": torch_threads,
    }
    local.connect_ray()
    try:
        base_url = local.deploy(config, port=local.free_port())

        async def measure() -> tuple[list[float], list[float], float]:
            client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0)
            try:
                await stream(client, model, latency[0])  # warm-up
                ttfts, itls = [], []
                for prompt in latency:
                    first, gaps = await stream(client, model, prompt)
                    ttfts.append(first)
                    itls.extend(gaps)
                start = time.perf_counter()
                await asyncio.gather(*(stream(client, model, p) for p in batch))
                return ttfts, itls, time.perf_counter() - start
            finally:
                await client.close()

        ttfts, itls, seconds = asyncio.run(measure())
    finally:
        local.shutdown()
    return {
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "itl_ms": statistics.median(itls) * 1e3,
        "output_tokens_per_s": BATCH * BATCH_OUTPUT / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small checkpoint")
    parser.add_argument("--rounds", type=int, default=5, help="single requests per system")
    parser.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="CPU threads per engine of the service, one run each (offline uses torch's default)",
    )
    parser.add_argument("--output", default="bench/results/service_overhead.json")
    args = parser.parse_args()
    latency = prompts(args.rounds, LATENCY_PROMPT, LATENCY_OUTPUT, seed=1)
    batch = prompts(BATCH, BATCH_PROMPT, BATCH_OUTPUT, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder, quick=args.quick)
        systems = {"offline": offline(folder, latency, batch)}
        for threads in args.torch_threads:
            for name, shape in SHAPES.items():
                systems[f"{name} t={threads}"] = served(folder, shape, threads, latency, batch)
    base = systems["offline"]
    print(f"{'system':>15} {'TTFT':>10} {'ITL':>9} {'tok/s @32':>10}   vs offline")
    for name, figures in systems.items():
        added = figures["ttft_ms"] - base["ttft_ms"]
        itl = figures["itl_ms"] / base["itl_ms"]
        rate = figures["output_tokens_per_s"] / base["output_tokens_per_s"]
        print(
            f"{name:>15} {figures['ttft_ms']:>8.1f}ms {figures['itl_ms']:>7.2f}ms "
            f"{figures['output_tokens_per_s']:>10.1f}   TTFT {added:+.1f} ms, ITL {itl:.2f}x, "
            f"tok/s {rate:.0%}"
        )
        figures |= {"ttft_added_ms": added, "itl_ratio": itl, "throughput_ratio": rate}
    write_result(
        args.output,
        {
            "benchmark": "service_overhead",
            "quick": args.quick,
            "machine": machine(),
            "latency": {"prompt_len": LATENCY_PROMPT, "output_len": LATENCY_OUTPUT},
            "throughput": {"concurrency": BATCH, "prompt_len": BATCH_PROMPT},
            "systems": systems,
        },
    )


if __name__ == "__main__":
    main()
