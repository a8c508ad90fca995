"""ModelRunner: the one place that turns scheduled requests into tensors and runs the model.

It owns the device: the weights, the KV block pool and Mamba slot pool tensors, and sampling.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hybridserve.workers.cache.manager import HybridCacheManager
from hybridserve.workers.cache_memory import CacheMemory
from hybridserve.workers.config import EngineConfig
from hybridserve.workers.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.models.loader import Checkpoint, load_model
from hybridserve.workers.pool_memory import zeroed_pool
from hybridserve.workers.sampler import Sampler, SamplingRow, mix_seed
from hybridserve.workers.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class RunnerOutput:
    sampled: list[int | None]  # per scheduled request, in scheduler order
    # request id -> logits (chunk_len, vocab) of every token of this step's chunk, for
    # requests that asked for prompt logits.
    chunk_logits: dict[str, torch.Tensor] = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is visible; use device='cpu'")
    return torch.device(device)


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.model_config: HybridModelConfig = checkpoint.config
        self.model = load_model(checkpoint, dtype=self.dtype, device=self.device)
        self.model.eval()
        self.model.pack_for_cpu()
        self.block_size = config.block_size
        self.num_kv_blocks = self._num_kv_blocks(max_model_len)
        self.num_mamba_slots = config.num_live_slots + config.num_snapshot_slots
        self.caches = self._allocate_caches()
        self.memory = CacheMemory(self.caches, config.host_cache_bytes)
        self.sampler = Sampler()
        # Requests whose every chunk's logits are kept (prompt scoring).
        self.keep_logits: set[str] = set()

    def _kv_bytes_per_block(self) -> int:
        spec = self.model_config.attention
        if spec is None:
            return 0
        elems = 2 * self.block_size * spec.num_kv_heads * spec.head_dim
        return self.model_config.num_attention_layers * elems * self.dtype.itemsize

    def _num_kv_blocks(self, max_model_len: int) -> int:
        config = self.config
        blocks_per_seq = -(-max_model_len // self.block_size)
        per_block = self._kv_bytes_per_block()
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
        return num_blocks

    def _allocate_caches(self) -> StateCaches:
        cfg = self.model_config
        kv = conv = ssm = None
        if cfg.attention is not None:
            kv = zeroed_pool(
                (
                    self.num_kv_blocks,
                    cfg.num_attention_layers,
                    2,
                    cfg.attention.num_kv_heads,
                    self.block_size,
                    cfg.attention.head_dim,
                ),
                self.dtype,
                self.device,
            )
        if cfg.mamba is not None:
            spec, slots, layers = cfg.mamba, self.num_mamba_slots, cfg.num_mamba_layers
            conv = zeroed_pool(
                (slots, layers, spec.conv_dim, spec.conv_kernel - 1), self.dtype, self.device
            )
            ssm = zeroed_pool(
                (slots, layers, spec.num_heads, spec.head_dim, spec.state_size),
                DTYPES[self.config.mamba_ssm_dtype],
                self.device,
            )
        logger.info(
            "caches: %d KV blocks x %d tokens, %d Mamba slots (%.1f MiB)",
            self.num_kv_blocks,
            self.block_size,
            self.num_mamba_slots,
            sum(t.numel() * t.element_size() for t in (kv, conv, ssm) if t is not None) / 2**20,
        )
        return StateCaches(kv=kv, conv=conv, ssm=ssm)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, cache: HybridCacheManager) -> RunnerOutput:
        # Decode rows first (one token continuing from the live slot), sorted by slot so that
        # their states form one contiguous run of the pool; then prefill chunks.
        def batch_position(i: int) -> tuple[bool, int]:
            item = out.scheduled[i]
            decode = _is_decode(item)
            return (not decode, cache.live_slot(item.request.request_id) if decode else 0)

        order = sorted(range(len(out.scheduled)), key=batch_position)
        items = [out.scheduled[i] for i in order]
        batch, row_ranges = self._build_batch(items, cache)
        hidden = self.model(batch, self.caches)
        logits = self.model.compute_logits(hidden[batch.logits_indices])

        sampled: list[int | None] = [None] * len(items)
        chunk_logits: dict[str, torch.Tensor] = {}
        sample_positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[SamplingRow] = []
        for position, (item, (first, last)) in enumerate(zip(items, row_ranges, strict=True)):
            if item.request.request_id in self.keep_logits:
                chunk_logits[item.request.request_id] = logits[first : last + 1]
            if item.samples:
                sample_positions.append(position)
                sample_rows.append(last)
                sampling.append(_sampling_row(item))
        if sample_rows:
            tokens = self.sampler.sample(logits[sample_rows], sampling)
            for position, token in zip(sample_positions, tokens, strict=True):
                sampled[order[position]] = token
        return RunnerOutput(sampled=sampled, chunk_logits=chunk_logits)

    def _build_batch(
        self, items: list[ScheduledRequest], cache: HybridCacheManager
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
        for item in items:
            request = item.request
            start, end = (
                request.num_computed_tokens,
                request.num_computed_tokens + item.num_new_tokens,
            )
            table = cache.block_table(request.request_id)
            slot = cache.live_slot(request.request_id)
            token_offset = len(input_ids)
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            tables.append(table)
            seq_lens.append(end)
            slots.append(slot)
            if _is_decode(item):
                num_decode += 1
            else:
                cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
                initial_slots.append(slot if start > 0 else -1)
            first_row = len(logits_indices)
            if request.request_id in self.keep_logits:
                logits_indices.extend(range(token_offset, len(input_ids)))
            elif item.samples:
                logits_indices.append(len(input_ids) - 1)
            row_ranges.append((first_row, len(logits_indices) - 1))

        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        batch = ForwardBatch(
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            slot_mapping=tensor(slot_mapping),
            num_decode=num_decode,
            block_tables=tensor(padded),
            seq_lens=tensor(seq_lens),
            mamba_slots=tensor(slots),
            prefill_cu_seqlens=tensor(cu_seqlens),
            prefill_initial_slots=tensor(initial_slots),
            logits_indices=tensor(logits_indices),
        )
        return batch, row_ranges


def _is_decode(item: ScheduledRequest) -> bool:
    """One token that continues from the live slot; everything else takes the prefill path."""
    return item.num_new_tokens == 1 and item.request.num_computed_tokens > 0


def _sampling_row(item: ScheduledRequest) -> SamplingRow:
    request = item.request
    params = request.sampling_params
    banned = tuple(request.stop_token_ids) if request.num_output_tokens < params.min_tokens else ()
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=mix_seed(request.sample_seed, request.num_output_tokens),
        banned_token_ids=banned,
    )
