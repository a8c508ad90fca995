"""The CUDA graphs path: decode steps replayed as CUDA graphs, one per batch-size bucket,
captured at start.

A decode step of a small model on a GPU is ~30 kernel launches per layer, each a few
microseconds of work behind ~5 µs of Python and launch; replaying a captured graph launches
them all in one call. A graph replays fixed addresses and shapes, so its inputs live in
persistent buffers (`DecodeInputs`) and a batch of R rows runs in the graph of the smallest
bucket B >= R, the rows past R padded:

    rows          | r0 | r1 | r2 | pad | pad | pad | pad | pad |     bucket 8, 3 rows
    state_slots   | the requests' |  -1 (the conv and state updates skip the row)
    slot_mapping  | KV slots      |  -1 (store_kv skips it)
    seq_lens      | context       |   0 (attention reads no block, outputs zeros)

So a padding row writes no state, and since rows never read each other (no MoE: its routing
sorts tokens across rows and sizes its batches on the host, which a graph cannot replay), its
values never reach a request. The block-table buffer is as wide as the longest sequence;
columns past a row's last block are stale and never read.

Buckets: 1, 2, 4, then multiples of 8 up to `max_rows`; larger decode steps, and every step
with a prompt chunk, go to the next path. A capture that fails drops the path.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.models.config import HybridModelConfig
from hybridserve.workers.models.hybrid import HybridForCausalLM
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.runner.paths.base import BatchPath

logger = logging.getLogger(__name__)

BUCKET_STEP = 8
MAX_GRAPH_ROWS = 512


def bucket_sizes(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ..., the last one >= max_rows."""
    max_rows = min(max_rows, MAX_GRAPH_ROWS)
    candidates = [1, 2, 4, *range(BUCKET_STEP, MAX_GRAPH_ROWS + 1, BUCKET_STEP)]
    sizes = [size for size in candidates if size < max_rows]
    return [*sizes, next(size for size in candidates if size >= max_rows)]


def graphs_unsupported(model: nn.Module, device: torch.device, tp_size: int) -> str | None:
    """Why this model's decode step cannot be captured here (None: it can)."""
    if device.type != "cuda":
        return "not on CUDA"
    if tp_size > 1:
        return f"tensor_parallel_size {tp_size} (graphs are captured at 1)"
    if not isinstance(model, HybridForCausalLM):
        return f"{type(model).__name__} is not a hybrid model"
    return graphs_model_unsupported(model.config)


def graphs_model_unsupported(config: HybridModelConfig) -> str | None:
    """Why no decode step of this model can be captured, wherever it runs (None: it can)."""
    if "moe" in (*config.layer_kinds, *config.mtp_layer_kinds):
        return "MoE layers route tokens on the host"
    return None


class DecodeInputs:
    """Persistent device buffers for a decode batch of up to `max_rows` rows, filled from a
    host batch through a staging buffer (pinned on CUDA): two copies a step."""

    FIELDS = ("input_ids", "positions", "slot_mapping", "seq_lens", "state_slots")

    def __init__(
        self,
        max_rows: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.max_rows = max_rows
        width = max(2, max_blocks_per_seq)
        size = (len(self.FIELDS) + width) * max_rows
        pin = device.type == "cuda"
        self._host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pin else None
        self._host_views = self._views(self._host, width)
        self.views = self._views(self._device, width)
        self._empty = torch.zeros(0, dtype=torch.int64, device=device)
        self._zero = torch.zeros(1, dtype=torch.int64, device=device)
        self._arange = torch.arange(max_rows, dtype=torch.int64, device=device)

    def _views(self, flat: torch.Tensor, width: int) -> dict[str, torch.Tensor]:
        rows = self.max_rows
        views = {name: flat[i * rows : (i + 1) * rows] for i, name in enumerate(self.FIELDS)}
        views["block_tables"] = flat[len(self.FIELDS) * rows :].view(rows, width)
        return views

    def batch(self, rows: int) -> ForwardBatch:
        """The first `rows` rows of the buffers as a decode batch (what a graph captures)."""
        views = self.views
        return ForwardBatch(
            input_ids=views["input_ids"][:rows],
            positions=views["positions"][:rows],
            slot_mapping=views["slot_mapping"][:rows],
            num_decode=rows,
            block_tables=views["block_tables"][:rows],
            seq_lens=views["seq_lens"][:rows],
            state_slots=views["state_slots"][:rows],
            prefill_cu_seqlens=self._zero,
            prefill_initial_slots=self._empty,
            logits_indices=self._arange[:rows],
        )

    def fill(self, batch: ForwardBatch, bucket: int) -> None:
        """Copy a host decode batch into rows [0, R) and padding into [R, bucket)."""
        rows, width = batch.num_decode, batch.block_tables.shape[1]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging buffer
        host = self._host_views
        for name in self.FIELDS:
            host[name][:rows] = getattr(batch, name)
        host["block_tables"][:rows, :width] = batch.block_tables
        pad = slice(rows, bucket)
        host["input_ids"][pad] = 0
        host["positions"][pad] = 0
        host["slot_mapping"][pad] = -1
        host["seq_lens"][pad] = 0
        host["state_slots"][pad] = -1
        # Two copies: the five per-row fields, then the table rows this bucket reads.
        fields_end = len(self.FIELDS) * self.max_rows
        tables_end = fields_end + bucket * host["block_tables"].shape[1]
        self._device[:fields_end].copy_(self._host[:fields_end], non_blocking=True)
        self._device[fields_end:tables_end].copy_(
            self._host[fields_end:tables_end], non_blocking=True
        )
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """The model's decode step captured per bucket; `run` replays the one a batch fits."""

    def __init__(
        self,
        model: nn.Module,
        caches: StateCaches,
        inputs: DecodeInputs,
        buckets: list[int],
    ) -> None:
        self.model, self.caches, self.inputs = model, caches, inputs
        self.buckets = sorted(buckets)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_replays = 0  # decode steps served by a graph

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket(self, rows: int) -> int | None:
        """The graph a batch of `rows` decode rows replays in (None: too many rows)."""
        return next((size for size in self.buckets if size >= rows), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory). Each is
        run eagerly first so that Triton compiles its kernels outside the capture; padding
        rows alone write nothing."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):
                batch = self._padding_batch(size)
                self.model(batch, self.caches)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[size] = self.model(batch, self.caches)
                self._graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "decode graphs: %d captured (batch sizes %s) in %.1f s",
            len(self._graphs),
            ", ".join(map(str, self.buckets)),
            time.perf_counter() - start,
        )

    def _padding_batch(self, size: int) -> ForwardBatch:
        empty = ForwardBatch(
            input_ids=torch.zeros(0, dtype=torch.int64),
            positions=torch.zeros(0, dtype=torch.int64),
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            num_decode=0,
            block_tables=torch.zeros(0, 2, dtype=torch.int64),
            seq_lens=torch.zeros(0, dtype=torch.int64),
            state_slots=torch.zeros(0, dtype=torch.int64),
            prefill_cu_seqlens=torch.zeros(1, dtype=torch.int64),
            prefill_initial_slots=torch.zeros(0, dtype=torch.int64),
            logits_indices=torch.zeros(0, dtype=torch.int64),
        )
        self.inputs.fill(empty, size)
        return self.inputs.batch(size)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states of a host decode batch (as `model(batch, caches)`)."""
        rows = batch.num_decode
        size = self.bucket(rows)
        assert size is not None and rows == batch.num_tokens, "a decode batch the graphs fit"
        self.inputs.fill(batch, size)
        self._graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size][:rows]


class CudaGraphsPath(BatchPath):
    name = "cuda_graphs"
    graphs: DecodeGraphs

    def unsupported(self) -> str | None:
        runner = self.runner
        return graphs_unsupported(runner.model, runner.device, runner.parallel.tp_size)

    def prepare(self) -> str | None:
        runner = self.runner
        buckets = bucket_sizes(runner.config.max_num_seqs)
        inputs = DecodeInputs(buckets[-1], runner.max_blocks_per_seq, runner.device)
        self.graphs = DecodeGraphs(runner.model, runner.caches, inputs, buckets)
        try:
            self.graphs.capture()
        except Exception as error:  # any capture failure means "not this path"
            logger.warning("decode graphs: capture failed (%s)", error)
            return f"capture failed: {error}"
        return None

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return all(c.is_decode for c in chunks) and self.graphs.bucket(len(chunks)) is not None

    @property
    def batch_device(self) -> torch.device:
        # On the host: the graphs' input buffers take it through a pinned staging copy.
        return torch.device("cpu")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.graphs.run(batch)
