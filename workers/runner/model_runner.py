"""ModelRunner: one rank's model shard and state pools; the one place that builds tensors.

It executes step plans (step_plan.py): the plan's cache ops first, in order, then one forward
pass over its chunks, run by the first of the engine's `forward_paths` that accepts them
(paths/). Under tensor parallelism every rank runs the same plan on its own shard; the driver
(rank 0) also samples, from logits gathered from every rank's vocabulary rows.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridserve.kernels import build_cpu_operators
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.outputs import Sample, TokenLogprobs
from hybridserve.workers.core.step_plan import (
    PENDING_TOKEN,
    SamplingRow,
    ScheduledChunk,
    StepPlan,
)
from hybridserve.workers.executors.parallel import ParallelContext, local_kv_heads
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.models.loader import Checkpoint, load_model
from hybridserve.workers.runner.block_tables import BlockTables
from hybridserve.workers.runner.cache_memory import CacheMemory
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.runner.host_memory import place_on_huge_pages, zeroed_pool
from hybridserve.workers.runner.mtp_drafts import mtp_drafts, shared_samples
from hybridserve.workers.runner.precision import (
    kv_cache_dtype,
    model_dtype,
    resolve_precision,
    state_dtype,
)
from hybridserve.workers.runner.sampler import (
    Sampler,
    prompt_logprobs,
)
from hybridserve.workers.speculative.verification import settle

if TYPE_CHECKING:
    from hybridserve.workers.runner.paths.base import ForwardPath

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class PoolSizes:
    """How many blocks and slots every rank's pools hold (ids are shared by all ranks)."""

    num_kv_blocks: int
    num_state_slots: int
    num_host_blocks: int = 0
    num_host_slots: int = 0


@dataclass
class RunnerOutput:
    samples: list[Sample | None]  # per plan chunk, in plan order
    # request id -> the prompt tokens this step's chunk scored (chunks with prompt_logprobs).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding with MTP layers: request id -> its drafts for the next step.
    drafts: dict[str, list[int]] = field(default_factory=dict)


def resolve_device(device: str, index: int = 0) -> torch.device:
    """`device` of the config; on CUDA, GPU `index` of this process's visible ones."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"this rank needs GPU {index}, but {torch.cuda.device_count()} are visible; "
                "lower tensor_parallel_size or expose more GPUs"
            )
        torch.cuda.set_device(index)  # NCCL and the kernels use the current device
        return torch.device("cuda", index)
    return torch.device(device)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint,
        parallel: ParallelContext,
        device_index: int | None = None,
    ) -> None:
        """`device_index`: this rank's GPU among the visible ones (default: its rank, one
        process per GPU of one machine)."""
        config = resolve_precision(config, checkpoint.raw_config)
        self.config = config
        self.parallel = parallel
        index = parallel.tp_rank if device_index is None else device_index
        self.device = resolve_device(config.device, index)
        self.dtype = model_dtype(config)
        self.model_config: HybridModelConfig = checkpoint.config
        attention = self.model_config.attention
        if attention and attention.latent and config.kv_cache_dtype == "fp8":
            raise ValueError(
                "kv_cache_dtype='fp8' is not supported for latent attention (this model's KV "
                "cache holds latents, kept in the model's dtype); use kv_cache_dtype='auto'"
            )
        # Speculative decoding with the checkpoint's multi-token-prediction layers: they load,
        # and their attention layers take KV layers after the model's own.
        self.uses_mtp = config.runs_mtp_layers
        self.model = load_model(
            checkpoint,
            dtype=self.dtype,
            device=self.device,
            parallel=parallel,
            keep_fp8=config.fp8_weights == "keep",
            mtp=self.uses_mtp,
        )
        self.model.eval()
        place_on_huge_pages(self.model)  # before the packed copies and kernels take addresses
        if self.device.type == "cpu":
            # The torch operators' C++ (kernels/operators.py) serves CPU tensors once built.
            build_cpu_operators()
        self.model.pack_for_cpu()
        self.max_blocks_per_seq = 0  # widest block table (pool_sizes)
        self.block_size = config.block_size
        self.sampler = Sampler()
        self.block_tables = BlockTables()
        # Async scheduling: per request, the token its last sampling chunk drew here, the input
        # of a following chunk built before the engine knew it (PENDING_TOKEN).
        self._sampled: dict[str, int] = {}
        self.caches = StateCaches(None)
        self.memory: CacheMemory | None = None
        # The forward paths to try, in order; those that cannot serve this model, device or
        # TP are left out now, those that fail to prepare once the pools exist.
        self.paths: list[ForwardPath] = []
        self._off: dict[str, str] = {}  # path name -> why it is not used
        for name in config.forward_paths:
            path = _create_path(name, self)
            reason = path.unsupported()
            if reason is None:
                self.paths.append(path)
            else:
                self._off[name] = reason

    # ---- pools ----------------------------------------------------------------------------

    @property
    def num_kv_layers(self) -> int:
        """The KV pool's layers: the attention layers, and the MTP ones when they run."""
        config = self.model_config
        return config.num_attention_layers + (
            config.num_mtp_attention_layers if self.uses_mtp else 0
        )

    def kv_bytes_per_block(self) -> int:
        """One block of this rank's KV pool: every KV layer, K and V (or the latent), its KV
        heads."""
        spec = self.model_config.attention
        if spec is None:
            return 0
        heads = local_kv_heads(spec, self.parallel.tp_size)
        elems = self.model_config.kv_planes * self.block_size * heads * spec.head_dim
        return self.num_kv_layers * elems * kv_cache_dtype(self.config).itemsize

    def pool_sizes(self, max_model_len: int) -> PoolSizes:
        """Block and slot counts from the config, or from the memory left on this rank."""
        config = self.config
        blocks_per_seq = -(-max_model_len // self.block_size)
        self.max_blocks_per_seq = blocks_per_seq
        per_block = self.kv_bytes_per_block()
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif config.kv_cache_memory_bytes is not None:
            num_blocks = config.kv_cache_memory_bytes // max(per_block, 1)
        else:
            wanted = config.max_num_seqs * blocks_per_seq
            budget = DEFAULT_CPU_KV_BYTES
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                # Activations and the CUDA graphs' pools come out of the share too: a tenth of
                # what is left for the pools is kept for them.
                budget = int(0.9 * (total * config.gpu_memory_utilization - (total - free)))
                if budget <= 0:
                    raise ValueError(
                        f"gpu_memory_utilization={config.gpu_memory_utilization} leaves no "
                        f"memory for the KV pool: {(total - free) / 2**30:.1f} GiB of the GPU's "
                        f"{total / 2**30:.1f} GiB are taken already; raise it"
                    )
            num_blocks = wanted if per_block == 0 else min(wanted, budget // per_block)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool has {num_blocks} blocks of {self.block_size} tokens, but one "
                f"max_model_len={max_model_len} request needs {blocks_per_seq}: raise "
                "num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        num_slots = config.num_live_slots + config.num_checkpoint_slots + config.num_snapshot_slots
        return PoolSizes(num_blocks, num_slots)

    def allocate_pools(self, sizes: PoolSizes, host_counts: tuple[int, int] | None = None) -> None:
        """This rank's shard of the pools; `host_counts` fixes the host tier (else it follows
        from host_cache_bytes). `self.memory` reports the host tier it really got."""
        cfg = self.model_config
        tp = self.parallel.tp_size
        kv = None
        if cfg.attention is not None:
            kv = zeroed_pool(
                (
                    sizes.num_kv_blocks,
                    self.num_kv_layers,
                    cfg.kv_planes,
                    local_kv_heads(cfg.attention, tp),
                    self.block_size,
                    cfg.attention.head_dim,
                ),
                kv_cache_dtype(self.config),
                self.device,
            )
        state = {}
        if cfg.recurrent_state is not None:
            for tensor in cfg.recurrent_state.tensors:
                state[tensor.name] = zeroed_pool(
                    (sizes.num_state_slots, cfg.num_recurrent_layers, *tensor.local_shape(tp)),
                    state_dtype(self.config, tensor.role),
                    self.device,
                )
        self.caches = StateCaches(kv=kv, state=state)
        self.memory = CacheMemory(self.caches, self.config.host_cache_bytes, host_counts)
        self._prepare_paths()
        logger.info(
            "rank %d caches: %d KV blocks x %d tokens, %d state slots (%.1f MiB)",
            self.parallel.tp_rank,
            sizes.num_kv_blocks,
            self.block_size,
            sizes.num_state_slots,
            sum(t.numel() * t.element_size() for t in self.caches.pools().values()) / 2**20,
        )

    def _prepare_paths(self) -> None:
        """Prepare each path over the new pools and log, once per path, whether it is on."""
        ready = []
        for path in self.paths:
            reason = path.prepare()
            if reason is None:
                ready.append(path)
            else:
                self._off[path.name] = reason
        self.paths = ready
        if self.parallel.is_driver:
            for name in self.config.forward_paths:
                if name in self._off:
                    logger.info("forward path %s: off (%s)", name, self._off[name])
                else:
                    logger.info("forward path %s: on", name)

    def path(self, name: str) -> ForwardPath | None:
        """The path `name` if this runner uses it."""
        return next((path for path in self.paths if path.name == name), None)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput | None:
        """Apply the plan's cache ops, run its chunks; the driver's result (None elsewhere)."""
        assert self.memory is not None, "allocate_pools() first"
        self.block_tables.apply(plan)
        for request_id in plan.released:
            self._sampled.pop(request_id, None)
        for chunk in plan.chunks:
            if chunk.token_ids[-1] == PENDING_TOKEN:
                chunk.token_ids[-1] = self._sampled[chunk.request_id]
        self.memory.apply(plan.cache_ops)
        if not plan.chunks:
            return RunnerOutput([]) if self.parallel.is_driver else None
        chunks = plan.chunks
        path = next(path for path in self.paths if path.accepts(chunks))
        output = path.run(chunks)
        if output is not None and self.config.async_scheduling:
            for chunk, sample in zip(chunks, output.samples, strict=True):
                if sample is not None:
                    self._sampled[chunk.request_id] = sample.token_ids[0]
        return output

    def sample_hidden(
        self,
        items: list[ScheduledChunk],
        order: list[int],
        batch: ForwardBatch,
        hidden: torch.Tensor,
        row_ranges: list[tuple[int, int]],
    ) -> RunnerOutput | None:
        """The step's output from the final hidden states of `batch` (built from `items`,
        plan chunk `order[i]` being `items[i]`): the logits of the rows that need them, then
        samples and prompt scores (`sample`). None on ranks other than the driver."""
        logits_indices = batch.logits_indices
        output = None
        if logits_indices.numel() == 0:
            # Only mid-prompt chunks: no logits are needed, on any rank.
            if self.parallel.is_driver:
                output = RunnerOutput([None] * len(items))
        else:
            # Row indices in increasing order: as many as rows means every row (a decode
            # batch).
            every_row = logits_indices.numel() == hidden.shape[0]
            logits = self.model.compute_logits(hidden if every_row else hidden[logits_indices])
            # Rank 0 samples; the other ranks get None.
            if logits is not None:
                output = self.sample(items, order, logits, row_ranges)
        if self.uses_mtp:
            self.propose_with_mtp(items, order, output, hidden)
        return output

    def propose_with_mtp(
        self,
        items: list[ScheduledChunk],
        order: list[int],
        output: RunnerOutput | None,
        hidden: torch.Tensor,
    ) -> None:
        """The MTP layers' guesses after this step (runner/mtp_drafts.py), into `output`
        (rank 0's; None on the others, which run their shard of the layers all the same).
        `hidden`: the step's final-normed hidden states, `items[i]` (plan chunk `order[i]`)
        owning the next `num_tokens` rows."""
        spec = self.config.speculative_config
        assert spec is not None
        samples = shared_samples(self, items, order, output)
        drafts = mtp_drafts(self, items, samples, hidden, spec.num_speculative_tokens)
        if output is not None:
            output.drafts = drafts

    def sample(
        self,
        items: list[ScheduledChunk],
        order: list[int],
        logits: torch.Tensor,
        row_ranges: list[tuple[int, int]],
    ) -> RunnerOutput:
        """Samples and prompt scores of the step's chunks, `items[i]` being plan chunk
        `order[i]` and scoring `logits[first : last + 1]` for `(first, last) = row_ranges[i]`."""
        samples: list[Sample | None] = [None] * len(items)
        scored: dict[str, list[TokenLogprobs]] = {}
        sample_positions: list[int] = []
        sample_rows: list[int] = []
        rows: list[SamplingRow] = []
        positions: list[int] = []  # per row, the index of the token it draws
        drafts: list[int | None] = []
        for position, (chunk, (first, last)) in enumerate(zip(items, row_ranges, strict=True)):
            if chunk.prompt_logprobs is not None:
                targets = chunk.token_ids[1:]
                if chunk.next_token_id is not None:
                    targets.append(chunk.next_token_id)
                scored[chunk.request_id] = prompt_logprobs(
                    logits[first : last + 1], targets, chunk.prompt_logprobs
                )
            if chunk.sampling is not None:
                # A verify chunk samples its last rows, one per draft and one after them.
                num_drafts = len(chunk.draft_rows)
                sample_positions.append(position)
                sample_rows.extend(range(last - num_drafts, last + 1))
                rows.extend(chunk.sampling_rows)
                positions.extend(range(chunk.end - num_drafts, chunk.end + 1))
                drafts.extend([*chunk.draft_token_ids, None])
        if sample_rows:
            # Every row, as in a decode step, needs no gather (indexing with a Python list
            # costs ~0.2 ms a step).
            every_row = sample_rows == list(range(logits.shape[0]))
            picked = logits if every_row else logits[torch.tensor(sample_rows)]
            verifies = len(rows) > len(sample_positions)
            drawn = self.sampler.sample(picked, rows, positions, drafts if verifies else None)
            at = 0
            for position in sample_positions:
                chunk = items[position]
                count = len(chunk.draft_rows) + 1
                samples[order[position]] = settle(drawn[at : at + count], chunk.draft_token_ids)
                at += count
        return RunnerOutput(samples=samples, prompt_logprobs=scored)

    def build_batch(
        self, items: list[ScheduledChunk], device: torch.device
    ) -> tuple[ForwardBatch, list[tuple[int, int]]]:
        """The packed batch, plus per item the (first, last) rows it owns in the logits."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        initial_slots: list[int] = []
        logits_indices: list[int] = []
        row_ranges: list[tuple[int, int]] = []
        num_decode = 0
        for chunk in items:
            start, end, table = chunk.start, chunk.end, chunk.block_ids
            token_offset = len(input_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
            seq_lens.append(end)
            slots.append(chunk.slot)
            if chunk.is_decode:
                num_decode += 1
            else:
                cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
                initial_slots.append(chunk.slot if start > 0 else -1)
            first_row = len(logits_indices)
            if chunk.prompt_logprobs is not None:
                logits_indices.extend(range(token_offset, len(input_ids)))
            elif chunk.sampling is not None:
                # The last row, and with drafts the row before each of them too.
                end_row = len(input_ids)
                logits_indices.extend(range(end_row - 1 - len(chunk.draft_rows), end_row))
            row_ranges.append((first_row, len(logits_indices) - 1))

        # Two columns at least: the compiled decode step's graph takes any width but 1 (the
        # compiler specialises a size of 1); past a row's last block, columns are ignored.
        width = max(2, *(len(t) for t in tables))
        # Row by row through numpy: 3x faster than a nested list at 256 rows of 512 blocks
        # (7 -> 2 ms), never slower for short tables.
        padded = np.zeros((len(tables), width), dtype=np.int64)
        for row, table in enumerate(tables):
            padded[row, : len(table)] = table

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        batch = ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slot_mapping),
            num_decode=num_decode,
            block_tables=torch.from_numpy(padded).to(device),
            seq_lens=tensor(seq_lens),
            state_slots=tensor(slots),
            prefill_cu_seqlens=tensor(cu_seqlens),
            prefill_initial_slots=tensor(initial_slots),
            logits_indices=tensor(logits_indices),
        )
        return batch, row_ranges


def _create_path(name: str, runner: ModelRunner) -> ForwardPath:
    """The registered forward path `name` (paths/__init__.py), made for `runner`."""
    from hybridserve.workers.runner.paths import FORWARD_PATHS

    module, cls = FORWARD_PATHS[name].split(":")
    path_class = getattr(importlib.import_module(f"hybridserve.workers.runner.paths.{module}"), cls)
    return path_class(runner)
