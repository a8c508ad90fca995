"""What serving costs on top of the engine: the same prompts offline and through the service,
colocated and 1 prefill + 1 decode, side by side in one run.

    python bench/service_overhead.py [--quick | --model tiny]
                                     [--output bench/results/service_overhead.json]

On the benchmark's random NemotronH checkpoint (bench/common.py; --quick: the small one), or
with `--model tiny` on the built-in `tiny` model, the fastest engine there is (a fraction of a
millisecond a token), where whatever the service adds per token shows:
- latency: one request at a time, a 90-token prompt and 64 output tokens, `--rounds` times
  (fresh prompts): median time to first token, median inter-token latency, and the mean
  gap (each request's first to last token over its gaps, averaged: what a stream takes per
  token, stalls included);
- throughput: 32 concurrent requests (128-token prompts, 64 output tokens): output tokens/s,
  best of 2, as one burst (all 32 sent at once) and sustained (32 streams, each sending its
  next request as its last one ends, `--sustained-requests` each; offline, the engine gets a
  stream's next request as its last one finishes). A burst's requests run in step; sustained
  load keeps prefill and decode busy at the same time, as a service's steady state does.
Offline is `Engine.step` driven in this process (a token counts when its step returns it).
The service runs on a local Ray cluster (`hybridserve serve`'s application), measured through
the official `openai` client streaming completions (a token counts when its chunk arrives),
at the ingress replica's own address when Serve runs with direct ingress (cluster/control/local.py),
else through Serve's proxy. Each service shape is measured alternately with the offline
engine, request by request and batch by batch, and its ratios (service / offline) are taken
against those offline figures. The service runs once per `--torch-threads` value (CPU threads
per engine; default 1 and 2). The offline engine runs with as many threads as the run's
largest engine (`--offline-threads N`: that many for every run, e.g. every core): the ratios
then compare one engine's speed served and offline, and a 1P1D deployment's two engines, each
on cores of its own where the machine has them, against one engine on its cores, as two GPUs
against one. A served engine shares its cores with the HTTP path (ingress, the client), and on
a small machine an engine that takes every core slows that path more than it gains. Each
shape's last run is repeated with `--stream-interval` tokens per streamed chunk (the service's
`stream_interval`): the path's CPU per token, which competes with the engine for the same
cores, goes down by about that factor.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridserve.bench.common import build_checkpoint, machine, write_result
from hybridserve.cluster.control import local
from hybridserve.kernels.cpu.threads import follow_torch_threads
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


# Prompt token ids are drawn below this (the model's vocabulary, set in main).
VOCAB = {"size": 4096}


def prompts(count: int, length: int, output: int, seed: int) -> list[Prompt]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Prompt(torch.randint(1, VOCAB["size"], (length,), generator=gen).tolist(), output)
        for _ in range(count)
    ]


class TokenClock:
    """When one request's tokens arrive: the time to the first, then the gap before each
    later token (the tokens of one chunk share its gap evenly: one chunk may carry several)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.gaps: list[float] = []

    def tick(self, num_tokens: int = 1) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now - self.start
            self.gaps.extend([0.0] * (num_tokens - 1))
        else:
            self.gaps.extend([(now - self.last) / num_tokens] * num_tokens)
        self.last = now


def offline_latency(llm: LLM, prompt: Prompt) -> tuple[float, list[float]]:
    """One request through `Engine.step` in this process: (time to first token, gaps)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=prompt.output_len, temperature=0.0, ignore_eos=True)
    clock = TokenClock()
    engine.add_request(prompt.token_ids, params)
    while engine.has_unfinished_requests():
        for _ in engine.step():
            clock.tick()
    assert clock.first is not None
    return clock.first, clock.gaps


def offline_throughput(llm: LLM, batch: list[Prompt]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(
        [p.token_ids for p in batch],
        SamplingParams(max_tokens=BATCH_OUTPUT, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    elapsed = time.perf_counter() - start
    assert sum(len(o.token_ids) for o in outputs) == BATCH * BATCH_OUTPUT
    return BATCH * BATCH_OUTPUT / elapsed


def offline_sustained(llm: LLM, streams: list[list[Prompt]]) -> float:
    """Output tok/s of `streams` offline: each stream's next prompt goes into the engine as
    its last request finishes."""
    engine = llm.engine
    waiting = [list(queue) for queue in streams]
    stream_of: dict[str, int] = {}

    def add(i: int) -> None:
        prompt = waiting[i].pop(0)
        params = SamplingParams(max_tokens=prompt.output_len, temperature=0.0, ignore_eos=True)
        stream_of[engine.add_request(prompt.token_ids, params)] = i

    start, num_tokens = time.perf_counter(), 0
    for i in range(len(waiting)):
        add(i)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            num_tokens += len(output.token_ids)
            i = stream_of.pop(output.request_id)
            if waiting[i]:
                add(i)
    assert num_tokens == sum(p.output_len for queue in streams for p in queue)
    return num_tokens / (time.perf_counter() - start)


def sustained_streams(num_requests: int, seed: int) -> list[list[Prompt]]:
    return [
        prompts(num_requests, BATCH_PROMPT, BATCH_OUTPUT, seed + 1000 * i) for i in range(BATCH)
    ]


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
        clock.tick(len(token_ids))
        received += len(token_ids)
    assert clock.first is not None and received == prompt.output_len, (
        received,
        prompt.output_len,
    )
    return clock.first, clock.gaps


@dataclass
class Figures:
    """Median TTFT and inter-token latency of the single requests, best output tok/s at 32
    (a burst, and sustained)."""

    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    mean_gaps: list[float] = field(default_factory=list)  # per request
    rates: list[float] = field(default_factory=list)
    sustained_rates: list[float] = field(default_factory=list)

    def add(self, first: float, gaps: list[float]) -> None:
        self.ttfts.append(first)
        self.itls.extend(gaps)
        self.mean_gaps.append(statistics.mean(gaps))

    def summary(self) -> dict[str, float]:
        return {
            "ttft_ms": statistics.median(self.ttfts) * 1e3,
            "itl_ms": statistics.median(self.itls) * 1e3,
            "itl_mean_ms": statistics.mean(self.mean_gaps) * 1e3,
            "output_tokens_per_s": max(self.rates),
            "sustained_output_tokens_per_s": max(self.sustained_rates),
        }


@dataclass
class SideBySide:
    offline: dict[str, float]
    service: dict[str, float]
    entry: str  # "direct ingress" or "Serve proxy"
    cpu_wait_policy: str  # how the service's engines' threads waited (the Coordinator's choice)
    cpu_binding: dict[str, list[int] | None]  # engine -> the cores it was bound to (None: not)
    cpu_placements: list[dict[str, Any]]  # where the engines said they ran when placed
    offline_threads: int


@contextmanager
def engine_threads(count: int) -> Iterator[int]:
    """Run this thread's offline engine on `count` threads: torch's and OpenMP's count for
    the native C kernels (follow_torch_threads), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    follow_torch_threads()
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
        follow_torch_threads()


def side_by_side(
    llm: LLM,
    model_path: str,
    shape: dict[str, int],
    torch_threads: int | dict[str, int],
    stream_interval: int,
    rounds: int,
    sustained_requests: int,
    cpu_wait_policy: str,
    cpu_binding: str,
    offline_threads: int,
    seed: int,
) -> SideBySide:
    """The service and the offline engine (on `offline_threads` threads), measured
    alternately (request by request, then batch by batch, twice): this machine's speed drifts
    by tens of percent over minutes, and alternating puts both sides in the same phase. Prompts
    are fresh for every measurement (`seed`), so neither side finds them cached."""
    import openai

    model = "bench"
    config = shape | {
        "model": model_path,
        "served_model_name": model,
        "engine": ENGINE,
        "torch_threads": torch_threads,
        "stream_interval": stream_interval,
        "cpu_wait_policy": cpu_wait_policy,
        "cpu_binding": cpu_binding,
    }
    local.connect_ray()
    try:
        proxy_url = local.deploy(config, port=local.free_port())
        waited = local.coordinator().cpu_wait_policy.remote().result()
        bound = local.coordinator().cpu_binding.remote().result()
        placements = local.coordinator().cpu_placements.remote().result()
        direct_url = local.direct_url()
        base_url = direct_url or proxy_url
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0)
        offline, service = Figures(), Figures()
        warm_up, *latency = prompts(1 + rounds, LATENCY_PROMPT, LATENCY_OUTPUT, seed)
        with asyncio.Runner() as runner, engine_threads(offline_threads) as threads:
            try:
                offline_latency(llm, warm_up)
                runner.run(stream(client, model, warm_up))
                for prompt in latency:
                    offline.add(*offline_latency(llm, prompt))
                    service.add(*runner.run(stream(client, model, prompt)))
                for repeat in range(2):
                    batch = prompts(BATCH, BATCH_PROMPT, BATCH_OUTPUT, seed + 10 + repeat)
                    offline.rates.append(offline_throughput(llm, batch))
                    batch = prompts(BATCH, BATCH_PROMPT, BATCH_OUTPUT, seed + 20 + repeat)
                    start = time.perf_counter()
                    runner.run(_all(client, model, batch))
                    service.rates.append(BATCH * BATCH_OUTPUT / (time.perf_counter() - start))
                for repeat in range(2):
                    offline.sustained_rates.append(
                        offline_sustained(
                            llm, sustained_streams(sustained_requests, seed + 30 + repeat)
                        )
                    )
                    streams = sustained_streams(sustained_requests, seed + 40 + repeat)
                    start = time.perf_counter()
                    runner.run(_sustained(client, model, streams))
                    num_tokens = sum(p.output_len for queue in streams for p in queue)
                    service.sustained_rates.append(num_tokens / (time.perf_counter() - start))
            finally:
                runner.run(client.close())
    finally:
        local.shutdown()
    entry = "direct ingress" if direct_url else "Serve proxy"
    return SideBySide(
        offline.summary(), service.summary(), entry, waited, bound, placements, threads
    )


def bound_cores(binding: dict[str, list[int] | None]) -> str:
    """How the engines were bound, for the console: "cores prefill-0:0 decode-0:1" or
    "unbound"."""
    bound = {name: cores for name, cores in binding.items() if cores is not None}
    if not bound:
        return "unbound"
    return "cores " + " ".join(f"{n}:{','.join(map(str, c))}" for n, c in bound.items())


async def _all(client: Any, model: str, batch: list[Prompt]) -> None:
    await asyncio.gather(*(stream(client, model, p) for p in batch))


async def _sustained(client: Any, model: str, streams: list[list[Prompt]]) -> None:
    async def one(queue: list[Prompt]) -> None:
        for prompt in queue:
            await stream(client, model, prompt)

    await asyncio.gather(*(one(queue) for queue in streams))


def largest_engine(torch_threads: int | dict[str, int]) -> int:
    """The most threads any engine of a run has (`torch_threads` as ServiceConfig takes it)."""
    return torch_threads if isinstance(torch_threads, int) else max(torch_threads.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small checkpoint")
    parser.add_argument(
        "--model",
        choices=["bench", "tiny"],
        default="bench",
        help="bench: the benchmark's checkpoint; tiny: the built-in model",
    )
    parser.add_argument("--rounds", type=int, default=20, help="single requests per system")
    parser.add_argument(
        "--torch-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="CPU threads per engine of the service, one run each, and with two values one "
        "more 1P1D run (prefill the most, decode the fewest)",
    )
    parser.add_argument(
        "--offline-threads",
        type=int,
        default=None,
        help="threads of the offline engine in every run (default: those of the run's "
        "largest engine)",
    )
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=4,
        help="tokens per streamed chunk of each shape's last run, run again (1: no such runs)",
    )
    parser.add_argument(
        "--sustained-requests",
        type=int,
        default=3,
        help="requests per stream of the sustained throughput measurement (default: 3)",
    )
    parser.add_argument(
        "--cpu-wait-policy",
        choices=["auto", "active", "brief", "passive"],
        default="auto",
        help="the service's cpu_wait_policy (default: auto)",
    )
    parser.add_argument(
        "--cpu-binding",
        choices=["auto", "off"],
        default="auto",
        help="the service's cpu_binding (default: auto)",
    )
    parser.add_argument("--output", default="bench/results/service_overhead.json")
    args = parser.parse_args()
    if args.offline_threads is not None and args.offline_threads < 1:
        parser.error(f"--offline-threads {args.offline_threads}: at least 1")
    systems: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = "tiny"
        if args.model == "bench":
            model = tmp
            build_checkpoint(Path(tmp), quick=args.quick)
        with LLM(model, **ENGINE) as llm:
            VOCAB["size"] = llm.engine.model_config.vocab_size
            runs: list[tuple[str, dict[str, int], Any, int]] = [
                (f"{name} t={threads}", shape, threads, 1)
                for threads in args.torch_threads
                for name, shape in SHAPES.items()
            ]
            if len(set(args.torch_threads)) > 1:  # prefill on every core, decode beside
                most, fewest = max(args.torch_threads), min(args.torch_threads)
                runs.append(
                    (
                        f"1P1D t={most}P/{fewest}D",
                        SHAPES["1P1D"],
                        {"prefill": most, "decode": fewest},
                        1,
                    )
                )
            if args.stream_interval > 1:  # each shape's last run again
                last = {run[1]["num_prefill"]: run for run in runs}
                runs += [
                    (f"{label} si={args.stream_interval}", shape, threads, args.stream_interval)
                    for label, shape, threads, _ in last.values()
                ]
            for label, shape, threads, interval in runs:
                seed = 100 * (len(systems) + 1)
                run = side_by_side(
                    llm,
                    model,
                    shape,
                    threads,
                    interval,
                    args.rounds,
                    args.sustained_requests,
                    args.cpu_wait_policy,
                    args.cpu_binding,
                    largest_engine(threads)
                    if args.offline_threads is None
                    else args.offline_threads,
                    seed,
                )
                offline, service = run.offline, run.service
                systems[label] = {
                    "entry": run.entry,
                    "torch_threads": threads,
                    "stream_interval": interval,
                    "offline": offline,
                    "service": service,
                    "ttft_added_ms": service["ttft_ms"] - offline["ttft_ms"],
                    "itl_ratio": service["itl_ms"] / offline["itl_ms"],
                    "itl_mean_added_ms": service["itl_mean_ms"] - offline["itl_mean_ms"],
                    "cpu_wait_policy": run.cpu_wait_policy,
                    "cpu_binding": run.cpu_binding,
                    "cpu_placements": run.cpu_placements,
                    "offline_threads": run.offline_threads,
                    "throughput_ratio": service["output_tokens_per_s"]
                    / offline["output_tokens_per_s"],
                    "sustained_throughput_ratio": service["sustained_output_tokens_per_s"]
                    / offline["sustained_output_tokens_per_s"],
                }
    print(
        f"{'system':>22} {'TTFT':>17} {'ITL':>15} {'mean gap':>15} {'tok/s @32':>13} "
        f"{'sustained':>13}   service vs offline  (offline | service, measured alternately)"
    )
    for name, row in systems.items():
        off, srv = row["offline"], row["service"]
        print(
            f"{name:>22} {off['ttft_ms']:>6.1f} |{srv['ttft_ms']:>6.1f} ms "
            f"{off['itl_ms']:>5.2f} |{srv['itl_ms']:>5.2f} ms "
            f"{off['itl_mean_ms']:>5.2f} |{srv['itl_mean_ms']:>5.2f} ms "
            f"{off['output_tokens_per_s']:>5.0f} |{srv['output_tokens_per_s']:>5.0f}  "
            f"{off['sustained_output_tokens_per_s']:>5.0f} |"
            f"{srv['sustained_output_tokens_per_s']:>5.0f}   "
            f"TTFT {row['ttft_added_ms']:+.1f} ms, ITL {row['itl_ratio']:.2f}x, "
            f"tok/s {row['throughput_ratio']:.0%} / {row['sustained_throughput_ratio']:.0%}"
            f"  ({row['entry']}, threads wait {row['cpu_wait_policy']}, "
            f"{bound_cores(row['cpu_binding'])}, offline engine {row['offline_threads']} threads)"
        )
    write_result(
        args.output,
        {
            "benchmark": "service_overhead",
            "model": args.model,
            "quick": args.quick,
            "machine": machine(),
            "latency": {"prompt_len": LATENCY_PROMPT, "output_len": LATENCY_OUTPUT},
            "throughput": {
                "concurrency": BATCH,
                "prompt_len": BATCH_PROMPT,
                "output_len": BATCH_OUTPUT,
                "sustained_requests_per_stream": args.sustained_requests,
            },
            "systems": systems,
        },
    )


if __name__ == "__main__":
    main()
