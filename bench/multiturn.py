"""`hybridserve bench multiturn`: multi-turn chat against the running service, per router policy.

    hybridserve bench multiturn --launch --num-prefill 2 --num-decode 2 --num-users 8
    hybridserve bench multiturn --base-url http://127.0.0.1:8000 --api-key KEY
    python bench/multiturn.py ...                  (the same options)

Targets: `--base-url` drives a running service as it is (its own policy, its caches as they
are; one result labelled `--label`). `--launch` starts a local Ray cluster, deploys the service
(`--num-prefill` P + `--num-decode` D engines) and runs every policy of `--policies` one after
another on that one deployment; before each, the router switches policy and every engine drops
its cache, so each policy starts cold.

Workload (seeded, the same for every policy): `--num-users` conversations of `--num-turns`
turns. Users share `--num-system-prompts` system prompts; a user's first message adds
user-unique context; every answer is `--max-tokens` long (greedy, EOS ignored) and goes back
into the next turn's messages verbatim. Requests are streamed chat completions through the
official `openai` client with `return_token_ids` and `include_usage`.

Each request's cached tokens (usage) are compared with an oracle: the reuse an ideal cache could
give in this arrival order (`multiturn_stats.oracle_tokens`); `reuse_vs_oracle` = cached /
oracle tokens.

Output: a console table, JSON with `vllm bench serve` key names per policy (plus the reuse
figures and per-request lists; times in lists are seconds, as vLLM's), and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import time
import typing
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
from hybridserve.bench.multiturn_stats import (
    Conversation,
    RequestRecord,
    format_table,
    make_workload,
    oracle_tokens,
    summarize,
)
from hybridserve.cluster.routing.router import Policy

logger = logging.getLogger(__name__)

POLICIES: tuple[str, ...] = typing.get_args(Policy)


# ---- driving the service --------------------------------------------------------------------


async def _one_request(
    client: Any, model: str, messages: list[dict[str, str]], record: RequestRecord, args: Any
) -> str:
    """Stream one chat completion into `record`; returns the answer text."""
    start = time.perf_counter()
    last = start
    texts: list[str] = []
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    async for chunk in stream:
        now = time.perf_counter()
        prompt_ids = getattr(chunk, "prompt_token_ids", None)
        if prompt_ids:
            record.prompt_token_ids = list(prompt_ids)
        if chunk.usage is not None:
            record.prompt_tokens = chunk.usage.prompt_tokens
            record.output_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            record.cached_tokens = (details.cached_tokens or 0) if details else 0
        for choice in chunk.choices:
            content = choice.delta.content or ""
            ids = getattr(choice, "token_ids", None) or []
            texts.append(content)
            record.output_token_ids.extend(ids)
            if content or ids:
                if record.ttft_s is None:
                    record.ttft_s = now - start
                else:
                    record.itls_s.append(now - last)
                last = now
    record.end_s = record.start_s + (time.perf_counter() - start)
    return "".join(texts)


async def _conversation(
    client: Any,
    model: str,
    conversation: Conversation,
    args: Any,
    gate: asyncio.Semaphore,
    t0: float,
    records: list[RequestRecord],
    progress: Any,
) -> None:
    """All turns of one user, in order; a failed turn ends the conversation."""
    async with gate:
        messages: list[dict[str, str]] = []
        if conversation.system is not None:
            messages.append({"role": "system", "content": conversation.system})
        for turn, text in enumerate(conversation.user_messages, start=1):
            if turn > 1 and args.think_time > 0:
                await asyncio.sleep(args.think_time)
            messages.append({"role": "user", "content": text})
            record = RequestRecord(conversation.user, turn, time.perf_counter() - t0)
            records.append(record)
            try:
                answer = await _one_request(client, model, messages, record, args)
            except Exception as exc:  # any failure is a result: recorded, counted, reported
                record.error = f"{type(exc).__name__}: {exc}"[:500]
                logger.warning("user %d turn %d failed: %s", conversation.user, turn, exc)
            progress.update(1)
            if record.error is not None:
                return
            messages.append({"role": "assistant", "content": answer})


def _client(base_url: str, args: Any) -> Any:
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=args.api_key or "EMPTY",
        max_retries=0,
        timeout=args.request_timeout,
    )


async def _served_model(client: Any, base_url: str, args: Any) -> str:
    if args.served_model:
        return args.served_model
    try:
        return (await client.models.list()).data[0].id
    except Exception as exc:  # unreachable, wrong key, not an OpenAI server: say which
        raise RuntimeError(f"GET {base_url}/v1/models failed: {exc}") from exc


async def warm_up(base_url: str, args: Any, num_requests: int) -> None:
    """Short unrelated requests, one after another (first-call costs stay out of the results)."""
    client = _client(base_url, args)
    try:
        model = await _served_model(client, base_url, args)
        for i in range(num_requests):
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"warm-up {i}"}],
                max_tokens=2,
                temperature=0,
            )
    finally:
        await client.close()


async def run_policy(
    base_url: str, workload: list[Conversation], args: Any, label: str
) -> tuple[list[RequestRecord], float]:
    """Every conversation once against `base_url`; (records in send order, seconds)."""
    from tqdm import tqdm

    client = _client(base_url, args)
    try:
        model = await _served_model(client, base_url, args)
        gate = asyncio.Semaphore(args.concurrency or len(workload))
        records: list[RequestRecord] = []
        total = sum(len(c.user_messages) for c in workload)
        with tqdm(total=total, desc=label, unit="req", disable=not sys.stderr.isatty()) as bar:
            t0 = time.perf_counter()
            await asyncio.gather(
                *(_conversation(client, model, c, args, gate, t0, records, bar) for c in workload)
            )
            duration = time.perf_counter() - t0
    finally:
        await client.close()
    records.sort(key=lambda r: r.start_s)
    return records, duration


# ---- output ---------------------------------------------------------------------------------


def _git_sha() -> str | None:
    try:
        root = Path(__file__).resolve().parent
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _plain_args(args: Any) -> dict[str, Any]:
    out = {}
    for key, value in vars(args).items():
        if key == "api_key" and value:
            value = "<redacted>"
        if value is None or isinstance(value, (str, int, float, bool, list)):
            out[key] = value
    return out


def write_plots(results: dict[str, dict[str, Any]], plot_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plots (pip install hybridserve[bench])")
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    paths = [plot_dir / "multiturn_online_ttft.png", plot_dir / "multiturn_online_reuse.png"]

    fig, ax = plt.subplots(figsize=(6, 4))
    turns: set[int] = set()
    for name, s in results.items():
        per_turn = s["median_ttft_ms_per_turn"]
        turns.update(per_turn)
        ax.plot(list(per_turn), list(per_turn.values()), marker="o", label=name)
    ax.set_xticks(sorted(turns))
    ax.set(xlabel="turn", ylabel="median TTFT (ms)", title="TTFT per turn", ylim=(0, None))
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.arange(len(results))
    reused = [100 * s["reused_fraction"] for s in results.values()]
    oracle = [100 * s["oracle_fraction"] for s in results.values()]
    ax.bar(x - 0.2, reused, 0.4, label="reused (cached tokens)")
    ax.bar(x + 0.2, oracle, 0.4, label="oracle", color="lightgray", edgecolor="gray")
    ax.set_xticks(x, list(results))
    ax.set(ylabel="% of prompt tokens", title="Prompt tokens reused vs the oracle", ylim=(0, 100))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


# ---- command --------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target_arguments(parser)
    parser.set_defaults(num_prefill=2, num_decode=2)
    parser.add_argument("--label", default="service", help="result name with --base-url")
    launch = parser.add_argument_group("multiturn with --launch")
    launch.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the short requests that warm every engine before the first policy",
    )
    launch.add_argument(
        "--policies",
        default=None,
        help=f"router policies run one after another, each cold (default: {','.join(POLICIES)})",
    )

    work = parser.add_argument_group("workload")
    work.add_argument("--num-users", type=int, default=8, help="conversations (default: 8)")
    work.add_argument("--num-turns", type=int, default=4, help="turns each (default: 4)")
    work.add_argument("--num-system-prompts", type=int, default=2, help="shared (default: 2)")
    work.add_argument("--system-prompt-len", type=int, default=1000, help="chars (default: 1000)")
    work.add_argument(
        "--user-context-len", type=int, default=200, help="first-turn chars (default: 200)"
    )
    work.add_argument("--user-len", type=int, default=100, help="chars per turn (default: 100)")
    work.add_argument("--max-tokens", type=int, default=32, help="answer tokens (default: 32)")
    work.add_argument(
        "--concurrency", type=int, help="conversations in flight (default: all users)"
    )
    work.add_argument("--think-time", type=float, default=0.0, help="seconds between turns")
    work.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    work.add_argument("--request-timeout", type=float, default=600.0, help="seconds")

    out = parser.add_argument_group("output")
    out.add_argument("--output", default="bench/results/multiturn_online.json", help="JSON")
    out.add_argument("--plot-dir", default="bench/results", help="PNG plots go here")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument(
        "--metric-percentiles", default="99", help="comma list, e.g. 50,90,99 (default: 99)"
    )
    out.add_argument("--allow-failures", action="store_true", help="exit 0 even if requests failed")


def _check(args: Any) -> list[str]:
    check_target(args)
    for name in ("num_users", "num_turns", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if args.base_url:
        if args.policies is not None:
            raise ValueError("--policies needs --launch: a running service keeps its own policy")
        return [args.label]
    policies = [p.strip() for p in (args.policies or ",".join(POLICIES)).split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise ValueError(f"unknown --policies {unknown}; choose from {', '.join(POLICIES)}")
    return policies


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 on success, 1 if any request failed (without --allow-failures).
    Raises ValueError for bad options."""
    policies = _check(args)
    # p99 is always there: the table shows it.
    percentiles = sorted({99.0, *(float(p) for p in args.metric_percentiles.split(",") if p)})
    workload = make_workload(
        num_users=args.num_users,
        num_turns=args.num_turns,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        user_context_len=args.user_context_len,
        user_len=args.user_len,
        seed=args.seed,
    )
    results: dict[str, dict[str, Any]] = {}
    with target(args) as service:
        coordinator, base_url = service.coordinator, service.base_url
        if coordinator is not None:
            if not args.no_warmup:
                # Round-robin touches every engine: max(P, D) requests cover all pairs.
                coordinator.set_policy.remote("round-robin").result()
                num_warmup = max(args.num_prefill, args.num_decode)
                asyncio.run(warm_up(base_url, args, num_warmup))
            for policy in policies:
                coordinator.set_policy.remote(policy).result()
                coordinator.clear_caches.remote().result()  # returns once the index is empty
                records, duration = asyncio.run(run_policy(base_url, workload, args, policy))
                results[policy] = summarize(records, oracle_tokens(records), duration, percentiles)
        else:
            try:
                records, duration = asyncio.run(run_policy(base_url, workload, args, args.label))
            except RuntimeError as exc:
                print(f"bench multiturn: error: {exc}", file=sys.stderr)
                return 2
            results[args.label] = summarize(records, oracle_tokens(records), duration, percentiles)
        engines = service.engines()
        config = service.config

    print(format_table(results))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "multiturn_online",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git_sha(),
        "topology": topology_label(args),
        "engines": engines,
        "base_url": None if args.launch else base_url,
        "service_config": config,
        "config": _plain_args(args),
        "policies": results,
    }
    output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {output}")
    if not args.no_plots:
        for path in write_plots(results, Path(args.plot_dir)):
            print(f"wrote {path}")
    failed = sum(s["failed"] for s in results.values())
    if failed:
        errors = {e for s in results.values() for e in s["errors"] if e}
        print(f"{failed} requests failed, e.g. {sorted(errors)[:3]}", file=sys.stderr)
        return 0 if args.allow_failures else 1
    return 0
