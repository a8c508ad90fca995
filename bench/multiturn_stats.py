"""`hybridserve bench multiturn`'s pure parts: the workload, per-request records, the reuse
oracle, the summary (vLLM `bench serve` key names) and the console table. No Ray, no HTTP.

Oracle, per request: the longest common token prefix of its prompt with any sequence (prompt +
output) of a request that had completed before it was sent, at most len(prompt) - 1: what an
ideal cache could reuse in this arrival order. A real cache stays one token short of it on a
continuing turn (the last sampled token's state is never computed), so `reuse_vs_oracle` tops
out just under 1.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridserve.workers.cache.prefix_tree import common_prefix_len

_WORD_TEXT = (
    "the of and to in is for on with as by at from that this it be are was or an state model "
    "layer token cache block prefix snapshot engine request turn user system answer question "
    "memory attention mamba hybrid decode prefill router policy cluster serve stream chunk "
    "batch queue latency time first next last long short fast slow small large river mountain "
    "city garden window paper music light water stone green blue red yellow north south east "
    "west morning evening winter summer coffee table chair story letter number market bridge"
)
WORDS = tuple(_WORD_TEXT.split())


# ---- workload -------------------------------------------------------------------------------


def random_text(rng: random.Random, num_chars: int) -> str:
    """Random words from WORDS, exactly `num_chars` ASCII characters (~1 tiny-model token each)."""
    words: list[str] = []
    size = -1
    while size < num_chars:
        words.append(rng.choice(WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)[:num_chars]


@dataclass(frozen=True)
class Conversation:
    """One user: an optional shared system prompt and one user message per turn (the first
    one carries the user's own context)."""

    user: int
    system: str | None
    user_messages: tuple[str, ...]


def make_workload(
    *,
    num_users: int,
    num_turns: int,
    num_system_prompts: int,
    system_prompt_len: int,
    user_context_len: int,
    user_len: int,
    seed: int,
) -> list[Conversation]:
    rng = random.Random(seed)
    systems = [random_text(rng, system_prompt_len) for _ in range(num_system_prompts)]
    conversations = []
    for user in range(num_users):
        context = random_text(rng, user_context_len)
        messages = [random_text(rng, user_len) for _ in range(num_turns)]
        if context:
            messages[0] = f"{context}\n\n{messages[0]}"
        system = systems[user % len(systems)] if systems else None
        conversations.append(Conversation(user, system, tuple(messages)))
    return conversations


# ---- records, oracle, summary ---------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    """One chat request (`turn` counts from 1). Times are seconds since the policy's run began;
    `end_s` is None for a request that failed."""

    user: int
    turn: int
    start_s: float
    end_s: float | None = None
    ttft_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def e2el_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s


def oracle_tokens(records: list[RequestRecord]) -> list[int]:
    """Per record (same order), the reuse an ideal cache could give it: the longest common
    token prefix of its prompt with anything computed before it was sent, capped at
    len(prompt) - 1 (one token is always computed). Computed before = the prompt of a
    successful request sent strictly earlier (prefill caches it while the request still
    runs), or `prompt + output` of one that completed no later than this send. Failed requests
    get a figure too but are never a source.

    Side-effect free. Events are replayed in time order; known sequences are kept sorted, and
    the longest common prefix with a sorted set is reached at one of the two neighbours of
    the query's position.
    """
    events = [(r.start_s, 1, i) for i, r in enumerate(records)]
    events += [(r.end_s, 0, i) for i, r in enumerate(records) if r.ok and r.end_s is not None]
    events.sort()
    known: list[tuple[int, ...]] = []
    sent: list[tuple[float, tuple[int, ...]]] = []  # prompts not yet visible (same instant)
    oracle = [0] * len(records)
    for time_s, kind, i in events:
        while sent and sent[0][0] < time_s:
            bisect.insort(known, sent.pop(0)[1])
        record = records[i]
        if kind == 0:
            bisect.insort(known, (*record.prompt_token_ids, *record.output_token_ids))
            continue
        prompt = tuple(record.prompt_token_ids)
        at = bisect.bisect_left(known, prompt)
        best = max(
            (common_prefix_len(prompt, known[j]) for j in (at - 1, at) if 0 <= j < len(known)),
            default=0,
        )
        oracle[i] = max(0, min(best, len(prompt) - 1))
        if record.ok:
            sent.append((time_s, prompt))
    return oracle


def latency_stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values, dtype=float) * 1e3 if values else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(
    records: list[RequestRecord],
    oracle: list[int],
    duration_s: float,
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """vLLM `bench serve` metrics over the completed requests, the reuse figures, and the
    per-request lists (every request, in send order). Side-effect free."""
    ok = [i for i, r in enumerate(records) if r.ok]
    total_input = sum(records[i].prompt_tokens for i in ok)
    total_output = sum(records[i].output_tokens for i in ok)
    cached = sum(records[i].cached_tokens for i in ok)
    oracle_sum = sum(oracle[i] for i in ok)
    ttfts = [records[i].ttft_s for i in ok if records[i].ttft_s is not None]
    tpots = [
        (records[i].e2el_s - records[i].ttft_s) / (records[i].output_tokens - 1)  # type: ignore[operator]
        for i in ok
        if records[i].output_tokens > 1 and records[i].ttft_s is not None
    ]
    itls = [x for i in ok for x in records[i].itls_s]
    e2els = [records[i].e2el_s for i in ok]
    duration = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input": total_input,
        "total_output": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary |= latency_stats(name, values, percentiles)
    summary |= {
        "cached_tokens": cached,
        "oracle_tokens": oracle_sum,
        "reused_fraction": cached / total_input if total_input else 0.0,
        "oracle_fraction": oracle_sum / total_input if total_input else 0.0,
        "reuse_vs_oracle": cached / oracle_sum if oracle_sum else None,
        "median_ttft_ms_per_turn": median_ttft_per_turn(records),
        "input_lens": [r.prompt_tokens for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft_s for r in records],
        "itls": [r.itls_s for r in records],
        "e2els": [r.e2el_s for r in records],
        "cached": [r.cached_tokens for r in records],
        "oracle": list(oracle),
        "users": [r.user for r in records],
        "turns": [r.turn for r in records],
        "errors": [r.error or "" for r in records],
    }
    return summary


def median_ttft_per_turn(records: list[RequestRecord]) -> dict[int, float]:
    by_turn: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.ok and r.ttft_s is not None:
            by_turn[r.turn].append(r.ttft_s * 1e3)
    return {turn: float(np.median(v)) for turn, v in sorted(by_turn.items())}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per policy; `vs rr` is the reused fraction over round-robin's."""
    rr = results.get("round-robin", {}).get("reused_fraction")
    header = (
        f"{'policy':<16} {'requests':>8} {'failed':>6} {'reused %':>8} {'oracle %':>8} "
        f"{'reuse/oracle':>12} {'vs rr':>6} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}"
    )
    rows = [header, "-" * len(header)]
    for name, s in results.items():
        ratio = s["reuse_vs_oracle"]
        vs_rr = f"{s['reused_fraction'] / rr:.2f}" if rr else "-"
        rows.append(
            f"{name:<16} {s['completed'] + s['failed']:>8} {s['failed']:>6} "
            f"{100 * s['reused_fraction']:>8.1f} {100 * s['oracle_fraction']:>8.1f} "
            f"{'-' if ratio is None else f'{ratio:.2f}':>12} {vs_rr:>6} "
            f"{s['median_ttft_ms']:>11.1f} {s.get('p99_ttft_ms', float('nan')):>11.1f}"
        )
    return "\n".join(rows)
