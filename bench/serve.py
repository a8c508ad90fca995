"""`hybridserve bench serve`: request throughput and latency, as `vllm bench serve` measures it.

    hybridserve bench serve --launch --num-prefill 1 --num-decode 1 --prefill-tp 2 \\
        --dataset-name random --random-input-len 512 --random-output-len 128 --num-prompts 200
    hybridserve bench serve --base-url http://127.0.0.1:8000 --request-rate 4 --max-concurrency 16
    ray job submit -- hybridserve bench serve --launch ...     (on an existing Ray cluster)

Datasets (seeded; prompts are token ids, so no tokenizer round trip blurs their lengths):
- `random`: `--num-prompts` prompts of `--random-input-len` tokens (± `--random-range-ratio`),
  each after a shared `--random-prefix-len`-token prefix, asking for `--random-output-len`
  tokens (same ratio);
- `shared-prefix`: `--shared-prefix-num-prefixes` prefixes of `--shared-prefix-len` tokens, each
  followed by `--shared-prefix-suffix-len` unique tokens (prompts cycle over the prefixes).
Arrivals: `--request-rate` requests per second (inf: all at once), gaps drawn from a gamma
distribution of shape `--burstiness` (1: Poisson), at most `--max-concurrency` in flight.
Every request is a streamed completion with `ignore_eos` through the official `openai` client.

Output: a console summary and JSON with `vllm bench serve`'s keys (duration, completed,
total_input_tokens, request_throughput, output_throughput, mean/median/std/pXX of ttft, tpot,
itl, e2el in ms, the per-request lists) plus the topology and what each engine got. Exits 1 if
any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from hybridserve.bench.launch import (
    add_target_arguments,
    check_target,
    target,
    topology_label,
)
from hybridserve.bench.multiturn_stats import latency_stats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    output_len: int


@dataclass
class Record:
    input_len: int
    start_s: float = 0.0
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    latency_s: float | None = None
    output_len: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.latency_s is not None


def make_dataset(args: argparse.Namespace, vocab_size: int) -> list[Prompt]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def jittered(length: int) -> int:
        ratio = args.random_range_ratio
        return max(1, rng.randint(round(length * (1 - ratio)), round(length * (1 + ratio))))

    prompts = []
    if args.dataset_name == "random":
        prefix = tokens(args.random_prefix_len)
        for _ in range(args.num_prompts):
            prompts.append(
                Prompt(
                    prefix + tokens(jittered(args.random_input_len)),
                    jittered(args.random_output_len),
                )
            )
        return prompts
    prefixes = [tokens(args.shared_prefix_len) for _ in range(args.shared_prefix_num_prefixes)]
    for i in range(args.num_prompts):
        prompt = prefixes[i % len(prefixes)] + tokens(args.shared_prefix_suffix_len)
        prompts.append(Prompt(prompt, args.shared_prefix_output_len))
    return prompts


async def _one(client: Any, model: str, prompt: Prompt, record: Record, timeout: float) -> None:
    start = time.perf_counter()
    last = start
    try:
        stream = await client.completions.create(
            model=model,
            prompt=prompt.token_ids,
            max_tokens=prompt.output_len,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=timeout,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                record.output_len = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                if record.ttft_s is None:
                    record.ttft_s = now - start
                else:
                    record.itls_s.append(now - last)
                last = now
        record.latency_s = time.perf_counter() - start
        if record.output_len != prompt.output_len:
            record.error = f"{record.output_len} of {prompt.output_len} tokens came back"
    except Exception as exc:  # any failure is a result: recorded, counted, reported
        record.error = f"{type(exc).__name__}: {exc}"[:500]


async def run_benchmark(
    base_url: str, prompts: list[Prompt], args: argparse.Namespace, model: str
) -> tuple[list[Record], float]:
    """Every prompt once, arriving at `--request-rate`; (records in prompt order, seconds)."""
    import openai
    from tqdm import tqdm

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=args.api_key or "EMPTY", max_retries=0
    )
    rng = np.random.default_rng(args.seed)
    gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
    records = [Record(len(p.token_ids)) for p in prompts]
    bar = tqdm(total=len(prompts), unit="req", disable=not sys.stderr.isatty())

    async def limited(prompt: Prompt, record: Record, t0: float) -> None:
        async with gate:
            record.start_s = time.perf_counter() - t0
            await _one(client, model, prompt, record, args.request_timeout)
            bar.update(1)

    try:
        t0 = time.perf_counter()
        tasks = []
        for prompt, record in zip(prompts, records, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, record, t0)))
            if math.isfinite(args.request_rate):
                # Gamma gaps of mean 1 / rate; shape 1 is a Poisson process.
                gap = rng.gamma(args.burstiness, 1.0 / (args.request_rate * args.burstiness))
                await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    finally:
        bar.close()
        await client.close()
    return records, duration


def summarize(records: list[Record], duration: float, percentiles: list[float]) -> dict[str, Any]:
    """`vllm bench serve`'s result keys over the requests that completed."""
    ok = [r for r in records if r.ok]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    duration = max(duration, 1e-9)
    tpots = [
        (r.latency_s - r.ttft_s) / (r.output_len - 1)  # type: ignore[operator]
        for r in ok
        if r.output_len > 1 and r.ttft_s is not None
    ]
    summary: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (
        ("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itls_s]),
        ("e2el", [r.latency_s for r in ok]),
    ):
        summary |= latency_stats(name, values, percentiles)  # type: ignore[arg-type]
    summary |= {
        "input_lens": [r.input_len for r in records],
        "output_lens": [r.output_len for r in records],
        "ttfts": [r.ttft_s for r in records],
        "itls": [r.itls_s for r in records],
        "errors": [r.error for r in records],
    }
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=["random", "shared-prefix"], default="random")
    data.add_argument("--num-prompts", type=int, default=100, help="(default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=256, help="(default: %(default)s)")
    data.add_argument("--random-output-len", type=int, default=64, help="(default: %(default)s)")
    data.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="lengths vary by ± this fraction"
    )
    data.add_argument(
        "--random-prefix-len", type=int, default=0, help="tokens every random prompt starts with"
    )
    data.add_argument("--shared-prefix-num-prefixes", type=int, default=4)
    data.add_argument("--shared-prefix-len", type=int, default=512)
    data.add_argument("--shared-prefix-suffix-len", type=int, default=64)
    data.add_argument("--shared-prefix-output-len", type=int, default=64)
    data.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="prompt token ids are drawn from [0, this) (default: %(default)s: any model's)",
    )
    data.add_argument("--seed", type=int, default=0, help="dataset and arrivals (default: 0)")

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests/s (default: inf)"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)"
    )
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds")

    out = parser.add_argument_group("output")
    out.add_argument("--output", default="bench/results/serve.json", help="the result JSON")
    out.add_argument(
        "--metric-percentiles", default="99", help="comma list, e.g. 50,90,99 (default: 99)"
    )


def _check(args: argparse.Namespace) -> None:
    check_target(args)
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.request_rate <= 0 or args.burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.vocab_size < 1:
        raise ValueError("--vocab-size must be at least 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError("--random-range-ratio must be in [0, 1)")


async def _served_model(base_url: str, args: argparse.Namespace) -> str:
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key=args.api_key or "EMPTY", max_retries=0
    )
    try:
        return args.served_model or (await client.models.list()).data[0].id
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if every request completed, 1 otherwise. Raises ValueError for
    bad options."""
    _check(args)
    percentiles = sorted({99.0, *(float(p) for p in args.metric_percentiles.split(",") if p)})
    with target(args) as service:
        try:
            model = asyncio.run(_served_model(service.base_url, args))
        except Exception as exc:  # unreachable, wrong key: every request would fail
            print(f"bench serve: GET {service.base_url}/v1/models failed: {exc}", file=sys.stderr)
            return 1
        prompts = make_dataset(args, args.vocab_size)
        records, duration = asyncio.run(run_benchmark(service.base_url, prompts, args, model))
        engines = service.engines()
        config = service.config
    result = summarize(records, duration, percentiles)
    document = {
        "benchmark": "serve",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "hybridserve",
        "model_id": model,
        "num_prompts": args.num_prompts,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "topology": topology_label(args),
        "engines": engines,
        "service_config": config,
        **result,
    }
    print(_table(document))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {output}")
    if result["failed"]:
        errors = sorted({e for e in result["errors"] if e})
        print(f"{result['failed']} requests failed, e.g. {errors[:3]}", file=sys.stderr)
        return 1
    return 0


def _table(d: dict[str, Any]) -> str:
    rows = [
        ("topology", d["topology"]),
        ("successful requests", d["completed"]),
        ("failed requests", d["failed"]),
        ("benchmark duration (s)", f"{d['duration']:.2f}"),
        ("total input tokens", d["total_input_tokens"]),
        ("total generated tokens", d["total_output_tokens"]),
        ("request throughput (req/s)", f"{d['request_throughput']:.2f}"),
        ("output token throughput (tok/s)", f"{d['output_throughput']:.2f}"),
        ("mean / median / p99 TTFT (ms)", _triple(d, "ttft")),
        ("mean / median / p99 TPOT (ms)", _triple(d, "tpot")),
        ("mean / median / p99 ITL (ms)", _triple(d, "itl")),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _triple(d: dict[str, Any], name: str) -> str:
    return f"{d[f'mean_{name}_ms']:.1f} / {d[f'median_{name}_ms']:.1f} / {d[f'p99_{name}_ms']:.1f}"
