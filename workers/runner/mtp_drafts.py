"""Drafts from the multi-token-prediction layers (models/mtp.py), at the end of a step.

The MTP layers need the target's hidden states, which exist only inside the step, so they
run right after it, in the same call, and their guesses are the next step's drafts
(`RunnerOutput.drafts`; workers/speculative/mtp.py hands them to the scheduler).

    target chunk:   positions s .. e-1, hidden h_s .. h_{e-1}
    next tokens:    x_{s+1} .. x_e    (the chunk's own, then the token after it: the next
                                       prompt token, or the one this step sampled)
    catch-up:       one MTP step over every position whose next token is known, writing the
                    MTP layers' KV there; a request that sampled guesses d1 from its last row
    k - 1 more:     one row each at the next positions, feeding d_j and the previous output

A verify chunk's positions count up to the last accepted draft: the rows after a rejected
draft are not the request's, and their KV is written again when the cursor passes them.
A request proposes only as far as its block table reaches (the scheduler allocates that
far ahead).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridserve.workers.core.outputs import Sample
from hybridserve.workers.core.step_plan import GREEDY_ROW, ScheduledChunk

if TYPE_CHECKING:
    from hybridserve.workers.runner.model_runner import ModelRunner, RunnerOutput


@torch.inference_mode()
def mtp_drafts(
    runner: ModelRunner,
    items: list[ScheduledChunk],
    samples: list[Sample | None],
    hidden: torch.Tensor,
    num_drafts: int,
) -> dict[str, list[int]]:
    """`items` in the order their rows are in `hidden` (the batch's final-normed hidden
    states), `samples[i]` item i's sample; each sampling request's next `num_drafts`
    guesses (fewer where its block table ends)."""
    model, caches = runner.model, runner.caches
    mtp = model.mtp
    assert mtp is not None
    catch_up: list[tuple[ScheduledChunk, list[int]]] = []  # (chunk, its rows of `hidden`)
    offset = 0
    for item, sample in zip(items, samples, strict=True):
        following = _following_tokens(item, sample)
        if following:
            chunk = ScheduledChunk(
                item.request_id,
                following,
                item.start,
                item.block_ids,
                item.slot,
                None if sample is None else GREEDY_ROW,
            )
            catch_up.append((chunk, list(range(offset, offset + len(following)))))
        offset += item.num_tokens
    if not catch_up:
        return {}
    # Decode-like rows first, as every batch lays them out (forward_batch.py).
    catch_up.sort(key=lambda pair: not pair[0].is_decode)
    chunks = [chunk for chunk, _ in catch_up]
    rows = torch.tensor([row for _, chunk_rows in catch_up for row in chunk_rows])
    batch, _ = runner.build_batch(chunks, runner.device)
    out = mtp(0, model.embed(batch.input_ids), hidden[rows.to(hidden.device)], batch, caches)
    proposing = [chunk for chunk in chunks if chunk.sampling is not None]
    if not proposing:
        return {}
    last = out[batch.logits_indices]
    drafts = {
        chunk.request_id: [token]
        for chunk, token in zip(proposing, _argmax(runner, last), strict=True)
    }
    # Chained steps, one row per request, as far as its block table reaches.
    for step in range(1, num_drafts):
        going = [
            i
            for i, chunk in enumerate(proposing)
            if chunk.end + step - 1 < len(chunk.block_ids) * runner.block_size
        ]
        if not going:
            break
        rows_now = [
            ScheduledChunk(
                proposing[i].request_id,
                [drafts[proposing[i].request_id][-1]],
                proposing[i].end + step - 1,
                proposing[i].block_ids,
                proposing[i].slot,
                GREEDY_ROW,
            )
            for i in going
        ]
        batch, _ = runner.build_batch(rows_now, runner.device)
        last = mtp(step, model.embed(batch.input_ids), last[going], batch, caches)
        proposing = [proposing[i] for i in going]
        for chunk, token in zip(proposing, _argmax(runner, last), strict=True):
            drafts[chunk.request_id].append(token)
    return drafts


def _argmax(runner: ModelRunner, hidden: torch.Tensor) -> list[int]:
    """Each row's most likely token, on every rank (the logits are gathered to rank 0, which
    shares its argmax)."""
    logits = runner.model.compute_logits(hidden)
    tokens = (
        logits.argmax(dim=-1)
        if logits is not None
        else torch.zeros(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    )
    return _from_driver(runner, tokens).tolist()


def shared_samples(
    runner: ModelRunner,
    items: list[ScheduledChunk],
    order: list[int],
    output: RunnerOutput | None,
) -> list[Sample | None]:
    """Item i's sample (`items[i]` is plan chunk `order[i]`) on every rank: what the MTP
    layers read of it (the drafts that stood, the new token) comes from rank 0, the one that
    sampled."""
    table = torch.full((len(items), 2), -1, dtype=torch.int64, device=runner.device)
    if output is not None:
        for i in range(len(items)):
            sample = output.samples[order[i]]
            if sample is not None:
                table[i, 0], table[i, 1] = len(sample.accepted), sample.token_ids[0]
    table = _from_driver(runner, table + 1) - 1  # zeros elsewhere: shift -1 out of them
    samples: list[Sample | None] = []
    for item, (num_accepted, token) in zip(items, table.tolist(), strict=True):
        if token < 0:
            samples.append(None)
            continue
        samples.append(Sample((token,), accepted=tuple(item.draft_token_ids[:num_accepted])))
    return samples


def _from_driver(runner: ModelRunner, tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (the others pass zeros of its shape)."""
    collectives = runner.parallel.collectives
    if runner.parallel.tp_size == 1 or collectives is None:
        return tensor
    if not runner.parallel.is_driver:
        tensor = torch.zeros_like(tensor)
    return collectives.all_reduce(tensor)


def _following_tokens(item: ScheduledChunk, sample: Sample | None) -> list[int]:
    """The token after each position of `item` that is known now, in order: the chunk's own
    tokens after the first, up to its last accepted draft, then the token after them."""
    if sample is None:
        if item.next_token_id is None:
            return item.token_ids[1:]
        return [*item.token_ids[1:], item.next_token_id]
    known = item.num_tokens - len(item.draft_rows)
    valid = known + len(sample.accepted)
    return [*item.token_ids[1:valid], sample.token_ids[0]]
