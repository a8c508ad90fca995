"""The draft-model proposer: a smaller checkpoint with the target's vocabulary guesses greedily.

The draft runs in the engine's process (beside rank 0, unsharded) with pools of its own: KV
blocks and a live state slot per request, plus a checkpoint slot, managed by a cache
coordinator of its own (no prefix caching). Each request has a shadow `Request` here whose
token list is the target request's own and whose cursor is how far the draft has computed.

One proposal round for a batch, each request with n known tokens and k drafts wanted:

    catch-up:  the draft computes [cursor, n) and samples d1     (one plan, every request)
               checkpoint its live state (the state after n tokens)
    k - 1 x:   it computes d_j and samples d_{j+1}                (one plan per j)

Its state is then the state after n + k - 1 tokens, d1..d_{k-1} included. After the target
verified: if d1..d_{k-1} stood, they are the request's tokens and the state stays (cursor
n + k - 1); otherwise the checkpoint goes back (cursor n): the same rollback as the
target's (cache/recurrent.py), so the draft's state never holds a rejected token either.
A request that ends, or is preempted, releases everything it holds here.
"""

from __future__ import annotations

from hybridserve.workers.cache.coordinator import CacheCoordinator
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.request import Request
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.step_plan import GREEDY_ROW, ScheduledChunk, StepPlan
from hybridserve.workers.executors.executor import UniExecutor
from hybridserve.workers.models.loader import open_checkpoint, read_model_config
from hybridserve.workers.speculative.proposer import Proposer


def check_draft_model(model: str, vocab_size: int, max_model_len: int) -> None:
    """Refuse a draft checkpoint the target cannot use (read from its config.json only, so
    an engine refuses it before it starts anything)."""
    draft = read_model_config(model)
    if draft.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model {model} has a vocabulary of "
            f"{draft.vocab_size} tokens, the target {vocab_size}: a draft must share the "
            "target's vocabulary"
        )
    if draft.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config: the draft model {model} takes "
            f"{draft.max_position_embeddings} positions, fewer than the target's "
            f"max_model_len={max_model_len}"
        )


class DraftModelProposer(Proposer):
    def __init__(self, target: EngineConfig, max_model_len: int, device: str) -> None:
        """The draft of `target` (checked by `check_draft_model`), on `device`."""
        spec = target.speculative_config
        assert spec is not None and spec.model is not None
        checkpoint = open_checkpoint(spec.model)
        seqs = target.max_num_seqs
        blocks_per_seq = -(-max_model_len // target.block_size)
        config = EngineConfig(
            model=spec.model,
            dtype=target.dtype,
            device=device,
            forward_paths=target.forward_paths,
            max_model_len=max_model_len,
            max_num_seqs=seqs,
            block_size=target.block_size,
            # Every running request at full length: the draft never preempts.
            num_kv_blocks=seqs * blocks_per_seq,
            # A live and a checkpoint slot per request (the runner sizes the pool by the
            # total; the coordinator below splits it).
            num_state_slots=2 * seqs,
            enable_prefix_caching=False,
        )
        self.executor = UniExecutor(config, checkpoint, max_model_len)
        self.cache = CacheCoordinator(
            num_blocks=self.executor.sizes.num_kv_blocks,
            block_size=target.block_size,
            num_live_slots=seqs,
            num_checkpoint_slots=seqs,
        )
        self._shadows: dict[str, Request] = {}
        # request id -> (known tokens when it last proposed, drafts proposed)
        self._proposed: dict[str, tuple[int, int]] = {}

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        shadows = [self._shadow(request) for request, _ in batch]
        wanted = [count for _, count in batch]
        for shadow, count in zip(shadows, wanted, strict=True):
            # Room for the catch-up and the drafts it feeds back (all but the last).
            needed = shadow.num_tokens + count - 1 - shadow.num_computed_tokens
            if self.cache.allocate(shadow, needed) is None:
                raise RuntimeError("the draft model's pools are sized for every request")
        firsts = self._step(
            shadows,
            [shadow.token_ids[shadow.num_computed_tokens :] for shadow in shadows],
        )
        drafts = [[token] for token in firsts]
        for shadow, count in zip(shadows, wanted, strict=True):
            self._proposed[shadow.request_id] = (shadow.num_tokens, count)
            shadow.num_computed_tokens = shadow.num_tokens
            if count > 1:
                self.cache.checkpoint(shadow)
        for j in range(1, max(wanted)):
            going = [i for i, count in enumerate(wanted) if count > j]
            nexts = self._step([shadows[i] for i in going], [[drafts[i][-1]] for i in going])
            for i, token in zip(going, nexts, strict=True):
                drafts[i].append(token)
                shadows[i].num_computed_tokens += 1
        return drafts

    def verified(self, request: Request, num_accepted: int) -> None:
        shadow = self._shadows.get(request.request_id)
        proposed = self._proposed.pop(request.request_id, None)
        if shadow is None or proposed is None:
            return
        known, count = proposed
        if count == 1:
            return  # nothing fed back: the state is the state after the known tokens
        if num_accepted >= count - 1:
            # The drafts fed back (all but the last) are the request's tokens now.
            self.cache.release_checkpoint(shadow)
        else:
            self.cache.rollback(shadow)
            shadow.num_computed_tokens = known

    def release(self, request: Request) -> None:
        shadow = self._shadows.pop(request.request_id, None)
        self._proposed.pop(request.request_id, None)
        if shadow is not None:
            self.cache.free(shadow)
            # A rollback logged for it goes with the next plan; applying it is harmless.

    def shutdown(self) -> None:
        self.executor.shutdown()

    def _shadow(self, request: Request) -> Request:
        shadow = self._shadows.get(request.request_id)
        if shadow is None:
            shadow = Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=SamplingParams(),
                stop_token_ids=frozenset(),
                sample_seed=0,
            )
            self._shadows[request.request_id] = shadow
        shadow.token_ids = request.token_ids  # the target's list: it grows with the request
        return shadow

    def _step(self, shadows: list[Request], tokens: list[list[int]]) -> list[int]:
        """One draft forward: each shadow computes `tokens` from its cursor and samples
        greedily after them; the sampled tokens, in order."""
        chunks = []
        for shadow, chunk in zip(shadows, tokens, strict=True):
            table_from, block_ids = self.cache.table_update(shadow.request_id)
            chunks.append(
                ScheduledChunk(
                    request_id=shadow.request_id,
                    token_ids=chunk,
                    start=shadow.num_computed_tokens,
                    block_ids=block_ids,
                    table_from=table_from,
                    slot=self.cache.live_slot(shadow.request_id),
                    sampling=GREEDY_ROW,
                )
            )
        plan = StepPlan(chunks, self.cache.take_ops(), self.cache.take_released())
        output = self.executor.execute(plan)
        return [sample.token_ids[0] for sample in output.samples]  # type: ignore[union-attr]
