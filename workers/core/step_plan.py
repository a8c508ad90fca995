"""The step plan: everything a rank needs to run one engine step, as a plain value.

The scheduler decides and the cache coordinator allocates; their decisions leave as a
`StepPlan`. A model runner (one per tensor-parallel rank) executes it without asking anyone
anything: first the cache ops, in order, then one forward pass over the chunks.

    StepPlan
      cache_ops   data moves the cache managers decided since the last plan (ops.py)
      released    requests whose block tables went since the last plan
      chunks      one per scheduled request:
                    token_ids  the tokens [start, start + n) to compute this step
                    block_ids  its block table from entry `table_from` on (token p lives in
                               block p // block_size): a rank keeps every request's table,
                               so a chunk carries only what changed since the request's last
                    slot       its live state slot (the state after `start` tokens)
                    sampling   how to sample its next token, when the chunk reaches the end
                               of the known tokens (None: a prompt chunk that does not)
                    draft_rows speculative decoding: the chunk ends with k draft tokens, and
                               these are the rows after each of them (the row at the last
                               known token tests the first draft, row j the draft after it)
                    prompt_logprobs  score the prompt tokens the chunk's rows predict

Plans cross process boundaries (the `mp` executor broadcasts them to every rank), so they are
versioned msgpack values with a round-trip test. See docs/step-plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from hybridserve.workers.cache.ops import CacheOp, op_from_wire, op_to_wire

PLAN_VERSION = 4
_MASK64 = (1 << 64) - 1
# Async scheduling: the input of a decode chunk whose token the step before is still
# sampling. A rank puts in the token it sampled for the request there (ModelRunner).
PENDING_TOKEN = -1


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 finaliser over each value)."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


# SamplingRow and ScheduledChunk are not frozen, though nothing changes them once built: the
# scheduler builds one of each per running request per step, and a frozen dataclass's
# __init__ sets every field through object.__setattr__ (~1.3 us more each; 256 running
# requests' host step went from ~3.1 to ~2.6 ms without it).
@dataclass(slots=True)
class SamplingRow:
    """How to sample from one logits row (sampler.py). Penalties need the tokens they count,
    so a row that uses them carries them; every other row carries nothing extra."""

    temperature: float
    top_p: float
    top_k: int | None
    # One draw per seed (the sampler mixes each with the position of the token drawn): a
    # request with n > 1 choices draws its n first tokens from its prompt's last row (the
    # fork, docs/sampling.md).
    seeds: tuple[int, ...]
    min_p: float = 0.0
    banned_token_ids: tuple[int, ...] = ()  # stop tokens before min_tokens is reached
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_token_ids: tuple[int, ...] = ()  # with penalties: the tokens generated so far
    prompt_token_ids: tuple[int, ...] = ()  # with a repetition penalty: the prompt's tokens
    # Structured output: bit t of 32-bit word t // 32 (little-endian) allows token t.
    allowed_token_bitmask: bytes | None = None
    num_logprobs: int | None = None  # return the drawn token's logprob and the top N


# Plain greedy sampling, for the engine's own guesses (a draft model's, MTP layers'): the
# token is the argmax, so no seed matters.
GREEDY_ROW = SamplingRow(0.0, 1.0, None, (0,))


@dataclass(slots=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]
    start: int  # the request's num_computed_tokens before this step
    block_ids: list[int]
    slot: int
    sampling: SamplingRow | None = None
    # Prompt scoring: each row's log-probability of the prompt token it predicts, and the top
    # N. Row i predicts token start + i + 1: the chunk's own next token, then `next_token_id`.
    prompt_logprobs: int | None = None
    # The token after the chunk (None when the chunk ends the known tokens): scored with
    # prompt logprobs, and the MTP layers' input at the chunk's last position.
    next_token_id: int | None = None
    # Speculative decoding: the last len(draft_rows) tokens are drafts to verify; row j of
    # draft_rows samples the position after draft j (its seed, mask and penalties as if the
    # drafts before it stood).
    draft_rows: tuple[SamplingRow, ...] = ()
    # `block_ids` holds the table's entries from this one on: what changed since the
    # request's last chunk. A rank fills in the rest before anything reads the chunk
    # (runner/block_tables.py), so there `table_from` is 0 and `block_ids` the whole table.
    table_from: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - len(self.draft_rows) :]

    @property
    def sampling_rows(self) -> list[SamplingRow]:
        """Every row this chunk samples, in order (none for a mid-prompt chunk)."""
        return [] if self.sampling is None else [self.sampling, *self.draft_rows]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token that continues from the live slot; everything else is a prefill chunk."""
        return len(self.token_ids) == 1 and self.start > 0


@dataclass(frozen=True)
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    cache_ops: list[CacheOp] = field(default_factory=list)
    released: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": PLAN_VERSION,
            "ops": [op_to_wire(op) for op in self.cache_ops],
            "released": self.released,
            "chunks": [
                [
                    c.request_id,
                    c.token_ids,
                    c.start,
                    c.block_ids,
                    c.slot,
                    None if c.sampling is None else _row_to_wire(c.sampling),
                    c.prompt_logprobs,
                    c.next_token_id,
                    [_row_to_wire(row) for row in c.draft_rows],
                    c.table_from,
                ]
                for c in self.chunks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepPlan:
        if data.get("v") != PLAN_VERSION:
            raise ValueError(f"step plan version {data.get('v')!r} is not {PLAN_VERSION}")
        try:
            chunks = [
                ScheduledChunk(
                    request_id=rid,
                    token_ids=list(token_ids),
                    start=start,
                    block_ids=list(block_ids),
                    slot=slot,
                    sampling=None if row is None else _row_from_wire(row),
                    prompt_logprobs=prompt_logprobs,
                    next_token_id=next_token_id,
                    draft_rows=tuple(_row_from_wire(r) for r in draft_rows),
                    table_from=table_from,
                )
                for (
                    rid,
                    token_ids,
                    start,
                    block_ids,
                    slot,
                    row,
                    prompt_logprobs,
                    next_token_id,
                    draft_rows,
                    table_from,
                ) in data["chunks"]
            ]
            ops = [op_from_wire(op) for op in data["ops"]]
            released = [str(request_id) for request_id in data["released"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed step plan: {exc}") from exc
        return cls(chunks, ops, released)

    def to_bytes(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_bytes(cls, payload: bytes) -> StepPlan:
        return cls.from_dict(msgpack.unpackb(payload, raw=False))


def _row_to_wire(row: SamplingRow) -> list[Any]:
    return [
        row.temperature,
        row.top_p,
        row.top_k,
        list(row.seeds),
        row.min_p,
        list(row.banned_token_ids),
        [list(pair) for pair in row.logit_bias],
        row.presence_penalty,
        row.frequency_penalty,
        row.repetition_penalty,
        list(row.output_token_ids),
        list(row.prompt_token_ids),
        row.allowed_token_bitmask,
        row.num_logprobs,
    ]


def _row_from_wire(data: list[Any]) -> SamplingRow:
    (
        temperature,
        top_p,
        top_k,
        seeds,
        min_p,
        banned,
        bias,
        presence,
        frequency,
        repetition,
        output_ids,
        prompt_ids,
        bitmask,
        num_logprobs,
    ) = data
    return SamplingRow(
        temperature,
        top_p,
        top_k,
        tuple(seeds),
        min_p,
        tuple(banned),
        tuple((int(t), float(b)) for t, b in bias),
        presence,
        frequency,
        repetition,
        tuple(output_ids),
        tuple(prompt_ids),
        bitmask,
        num_logprobs,
    )
