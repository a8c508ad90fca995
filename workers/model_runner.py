"""ModelRunner: one rank's model shard and state pools; the one place that builds tensors.

It executes step plans (step_plan.py): the plan's cache ops first, in order, then one forward
pass over its chunks. Under tensor parallelism every rank runs the same plan on its own shard;
the driver (rank 0) also samples, from logits gathered from every rank's vocabulary rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridserve.workers.cache_memory import CacheMemory
from hybridserve.workers.compiled_decode import CompiledDecode
from hybridserve.workers.config import EngineConfig
from hybridserve.workers.decode_graphs import (
    DecodeGraphs,
    DecodeInputs,
    bucket_sizes,
    graphs_unsupported,
)
from hybridserve.workers.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.host_memory import place_on_huge_pages, zeroed_pool
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.models.loader import Checkpoint, load_model
from hybridserve.workers.native_decode import MAX_ROWS as MAX_NATIVE_ROWS
from hybridserve.workers.native_decode import NativeDecode
from hybridserve.workers.outputs import Sample, TokenLogprobs
from hybridserve.workers.parallel import (
    ParallelContext,
    local_conv_sections,
    local_kv_heads,
)
from hybridserve.workers.sampler import Sampler, greedy_samples, is_plain_greedy, prompt_logprobs
from hybridserve.workers.step_plan import ScheduledChunk, StepPlan

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class PoolSizes:
    """How many blocks and slots every rank's pools hold (ids are shared by all ranks)."""

    num_kv_blocks: int
    num_mamba_slots: int
    num_host_blocks: int = 0
    num_host_slots: int = 0


@dataclass
class RunnerOutput:
    samples: list[Sample | None]  # per plan chunk, in plan order
    # request id -> the prompt tokens this step's chunk scored (chunks with prompt_logprobs).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


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
        self.config = config
        self.parallel = parallel
        index = parallel.tp_rank if device_index is None else device_index
        self.device = resolve_device(config.device, index)
        self.dtype = DTYPES[config.dtype]
        self.model_config: HybridModelConfig = checkpoint.config
        self.model = load_model(checkpoint, dtype=self.dtype, device=self.device, parallel=parallel)
        self.model.eval()
        place_on_huge_pages(self.model)  # before the packed copies and kernels take addresses
        self.model.pack_for_cpu()
        self.compiled_decode = CompiledDecode(self.model) if config.compile_decode else None
        unsupported = graphs_unsupported(self.model, self.device, parallel.tp_size)
        if config.cuda_graphs and unsupported and self.device.type == "cuda":
            logger.info("decode graphs off: %s", unsupported)
        self.capture_graphs = config.cuda_graphs and unsupported is None
        self.decode_graphs: DecodeGraphs | None = None
        self.native_decode: NativeDecode | None = None  # built with the pools
        self.max_blocks_per_seq = 0  # widest block table (pool_sizes)
        self.block_size = config.block_size
        self.sampler = Sampler()
        self.caches = StateCaches(None, None, None)
        self.memory: CacheMemory | None = None

    # ---- pools ----------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """One block of this rank's KV pool: every attention layer, K and V, its KV heads."""
        spec = self.model_config.attention
        if spec is None:
            return 0
        heads = local_kv_heads(spec, self.parallel.tp_size)
        elems = 2 * self.block_size * heads * spec.head_dim
        return self.model_config.num_attention_layers * elems * self.dtype.itemsize

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
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * 0.8)
            num_blocks = wanted if per_block == 0 else min(wanted, budget // per_block)
        if num_blocks < blocks_per_seq:
            raise ValueError(
                f"the KV pool has {num_blocks} blocks of {self.block_size} tokens, but one "
                f"max_model_len={max_model_len} request needs {blocks_per_seq}: raise "
                "num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        return PoolSizes(num_blocks, config.num_live_slots + config.num_snapshot_slots)

    def allocate_pools(self, sizes: PoolSizes, host_counts: tuple[int, int] | None = None) -> None:
        """This rank's shard of the pools; `host_counts` fixes the host tier (else it follows
        from host_cache_bytes). `self.memory` reports the host tier it really got."""
        cfg = self.model_config
        tp = self.parallel.tp_size
        kv = conv = ssm = None
        if cfg.attention is not None:
            kv = zeroed_pool(
                (
                    sizes.num_kv_blocks,
                    cfg.num_attention_layers,
                    2,
                    local_kv_heads(cfg.attention, tp),
                    self.block_size,
                    cfg.attention.head_dim,
                ),
                self.dtype,
                self.device,
            )
        if cfg.mamba is not None:
            spec, slots, layers = cfg.mamba, sizes.num_mamba_slots, cfg.num_mamba_layers
            conv = zeroed_pool(
                (slots, layers, sum(local_conv_sections(spec, tp)), spec.conv_kernel - 1),
                self.dtype,
                self.device,
            )
            ssm = zeroed_pool(
                (slots, layers, spec.num_heads // tp, spec.head_dim, spec.state_size),
                DTYPES[self.config.mamba_ssm_dtype],
                self.device,
            )
        self.caches = StateCaches(kv=kv, conv=conv, ssm=ssm)
        self.memory = CacheMemory(self.caches, self.config.host_cache_bytes, host_counts)
        if self.config.native_decode and self.device.type == "cpu":
            self.native_decode = NativeDecode.build(self.model, self.caches)
        if self.compiled_decode is not None:
            self.compiled_decode.warm_up(self.caches, max_rows=self.config.max_num_seqs)
        if self.capture_graphs:
            self._capture_decode_graphs()
        logger.info(
            "rank %d caches: %d KV blocks x %d tokens, %d Mamba slots (%.1f MiB)",
            self.parallel.tp_rank,
            sizes.num_kv_blocks,
            self.block_size,
            sizes.num_mamba_slots,
            sum(t.numel() * t.element_size() for t in (kv, conv, ssm) if t is not None) / 2**20,
        )

    def _capture_decode_graphs(self) -> None:
        buckets = bucket_sizes(self.config.max_num_seqs)
        inputs = DecodeInputs(buckets[-1], self.max_blocks_per_seq, self.device)
        graphs = DecodeGraphs(self.model, self.caches, inputs, buckets)
        try:
            graphs.capture()
        except Exception as error:  # any capture failure means "stay eager"
            logger.warning("decode graphs: capture failed, decode runs eagerly (%s)", error)
        else:
            self.decode_graphs = graphs

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> RunnerOutput | None:
        """Apply the plan's cache ops, run its chunks; the driver's result (None elsewhere)."""
        assert self.memory is not None, "allocate_pools() first"
        self.memory.apply(plan.cache_ops)
        if not plan.chunks:
            return RunnerOutput([]) if self.parallel.is_driver else None
        native, chunks = self.native_decode, plan.chunks
        if (
            native is not None
            and len(chunks) <= MAX_NATIVE_ROWS
            and all(c.is_decode for c in chunks)
        ):
            return self._execute_native(native, chunks)
        # Decode rows first (one token continuing from the live slot), sorted by slot so that
        # their states form one contiguous run of the pool; then prefill chunks.
        order = sorted(
            range(len(chunks)),
            key=lambda i: (not chunks[i].is_decode, chunks[i].slot if chunks[i].is_decode else 0),
        )
        items = [chunks[i] for i in order]
        graphs = self.decode_graphs
        if graphs is not None and all(c.is_decode for c in items) and graphs.bucket(len(items)):
            # On the host: the graphs' input buffers take it through a pinned staging copy.
            batch, row_ranges = self._build_batch(items, torch.device("cpu"))
            hidden = graphs.run(batch)
        else:
            batch, row_ranges = self._build_batch(items, self.device)
            decode_only = batch.num_decode == batch.num_tokens
            compiled = self.compiled_decode
            hidden = (compiled if decode_only and compiled else self.model)(batch, self.caches)
        logits_indices = batch.logits_indices
        if logits_indices.numel() == 0:
            # Only mid-prompt chunks: no logits are needed, on any rank.
            return RunnerOutput([None] * len(items)) if self.parallel.is_driver else None
        # Row indices in increasing order: as many as rows means every row (a decode batch).
        every_row = logits_indices.numel() == hidden.shape[0]
        logits = self.model.compute_logits(hidden if every_row else hidden[logits_indices])
        if logits is None:
            return None  # not the driver: rank 0 samples
        return self._outputs(items, order, logits, row_ranges)

    def _execute_native(self, native: NativeDecode, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """A few decode rows: no batch tensors; the forward, the LM head and each row's argmax
        are one C call. Rows of plain greedy decoding (the usual case) take that argmax as
        their token. Whether they all are is settled before the call: after it, the
        interpreter runs from caches that the step's weights have just flushed, several times
        slower, so it builds their samples and nothing else."""
        if all(
            c.sampling is not None and c.prompt_logprobs is None and is_plain_greedy(c.sampling)
            for c in chunks
        ):
            return RunnerOutput(greedy_samples(native(chunks).greedy_token_ids))
        logits = native(chunks).logits
        rows = range(len(chunks))
        return self._outputs(chunks, list(rows), logits, [(row, row) for row in rows])

    def _outputs(
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
        for position, (chunk, (first, last)) in enumerate(zip(items, row_ranges, strict=True)):
            if chunk.prompt_logprobs is not None:
                targets = chunk.token_ids[1:]
                if chunk.next_token_id is not None:
                    targets.append(chunk.next_token_id)
                scored[chunk.request_id] = prompt_logprobs(
                    logits[first : last + 1], targets, chunk.prompt_logprobs
                )
            if chunk.sampling is not None:
                sample_positions.append(position)
                sample_rows.append(last)
        if sample_rows:
            rows = [items[p].sampling for p in sample_positions]
            # Every row, as in a decode step, needs no gather (indexing with a Python list
            # costs ~0.2 ms a step).
            every_row = sample_rows == list(range(logits.shape[0]))
            picked = logits if every_row else logits[torch.tensor(sample_rows)]
            drawn = self.sampler.sample(picked, rows)  # type: ignore[arg-type]
            for position, sample in zip(sample_positions, drawn, strict=True):
                samples[order[position]] = sample
        return RunnerOutput(samples=samples, prompt_logprobs=scored)

    def _build_batch(
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
                logits_indices.append(len(input_ids) - 1)
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
            mamba_slots=tensor(slots),
            prefill_cu_seqlens=tensor(cu_seqlens),
            prefill_initial_slots=tensor(initial_slots),
            logits_indices=tensor(logits_indices),
        )
        return batch, row_ranges
