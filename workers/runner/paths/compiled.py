"""The compiled path: decode-only steps through `torch.compile`.

An eager decode step at one request spends more time in its ~1,400 small tensor ops (norms,
conv and state updates, gating, residual adds, views and casts) and their Python dispatch than
in its GEMMs. Compiled, the ops between two GEMMs fuse into one generated loop (C++ on the CPU,
Triton on CUDA) and the step is one call.

The compiler traces the same layers as the eager step. What it cannot trace, or would trace
badly, is a torch operator (kernels/operators.py), one opaque call with a C++ implementation
on the CPU: the pool reads and writes (a write through a per-layer view of a graph input
would copy the whole pool back every step), the packed CPU GEMMs, the SSM state update (the
compiler's own loop writes the new states to a temporary and copies them back, twice the
traffic) and the decode attention (the traced reference gathers every row's keys and values
before attending). The other dispatched kernels trace their torch reference, and the
compiler generates their code.

It runs at tensor_parallel_size 1: the compiled step has no collectives.

Shapes are dynamic: one graph serves every batch of two or more rows and every block-table
width (the runner pads tables to two columns at least, since the compiler specialises a size
of 1); one row gets a graph of its own. Both compile at engine start (`warm_up`), so no request
waits for the compiler; inductor's on-disk cache makes later starts quick. That holds because
the tracer does no duck shaping: by default it gives sizes that happen to be equal in the
traced batch one symbol, and the warm-up's table width (2) equalled the KV pool's K/V
dimension, so the first request longer than two blocks recompiled the step (12 s). Mixed and
prefill steps go to the next path. When the warm-up fails (no C++ compiler, say), the path
is dropped with the reason logged.

Guards: before each call the compiler checks that what it traced still holds: ~1,200 checks,
0.3 ms of a 4 ms step at one row, 1,050 of them on the model (its modules' hooks, attributes,
parameters). The model is fixed once loaded, so those are skipped and the batch's and the
globals' checks kept. That is safe only if no other model and no other layer can reach these
graphs, and the compiler keeps graphs per code object: so each instance compiles a function
of its own (`_own_copy`), never the class's `forward` that every engine of a family shares,
and the skip needs the step to be one graph (`fullgraph`): models with MoE layers, which
break it, keep every guard. (Skipping every guard after the warm-up, `skip_guard_eval_unsafe`,
picked a wrong graph for NemotronH: the batch's guards choose between the one-row and the
dynamic graph.)
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable

import torch
from torch import nn

from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.layers.moe import MoE
from hybridserve.workers.runner.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.runner.paths.base import BatchPath

logger = logging.getLogger(__name__)

# Every dynamic size its own symbol (see the module's docstring). Made once: a patch object
# may be entered again and again, and making one costs ~20 us (it defines a class).
_TRACING_CONFIG = torch.fx.experimental._config.patch(use_duck_shape=False)
# Rows of the warm-up batches: one, and the first size of the dynamic graph.
WARM_UP_ROWS = (1, 2)


class CompiledPath(BatchPath):
    name = "compiled"

    def unsupported(self) -> str | None:
        tp = self.runner.parallel.tp_size
        if tp > 1:
            return f"tensor_parallel_size {tp} (the compiled step has no collectives)"
        return None

    def prepare(self) -> str | None:
        model = self.runner.model
        # MoE layers break the graph (they size expert batches on the host); the compiler
        # then compiles pieces of the layers' own `forward`, which all layers share: there,
        # the model's guards are what tell one layer from another, so they stay.
        one_graph = not any(isinstance(module, MoE) for module in model.modules())
        self.compiled = torch.compile(
            _own_copy(_decode_forward),
            dynamic=True,
            fullgraph=one_graph,
            options=_options(one_graph),
        )
        self.num_compiled_steps = 0  # decode steps the compiled graphs ran (warm-up excluded)
        return self.warm_up(self.runner.caches, max_rows=self.runner.config.max_num_seqs)

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return all(chunk.is_decode for chunk in chunks)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        assert batch.num_decode == batch.num_tokens, "the compiled step runs decode rows only"
        self.num_compiled_steps += 1
        with _TRACING_CONFIG:
            return self.compiled(self.runner.model, batch, self.runner.caches)

    @torch.inference_mode()
    def warm_up(self, caches: StateCaches, max_rows: int) -> str | None:
        """Compile both graphs with batches on the first slots and blocks; their contents are
        put back afterwards. With `max_rows` 1 only the one-row graph is compiled. Why it
        failed (None: compiled)."""
        touched = max(WARM_UP_ROWS)  # slots (and at most blocks) the warm-up writes
        saved = [(pool, pool[:touched].clone()) for pool in _pools(caches)]
        start = time.perf_counter()
        try:
            with _TRACING_CONFIG:
                for rows in WARM_UP_ROWS:
                    if rows <= max_rows:
                        self.compiled(self.runner.model, _warm_up_batch(rows, caches), caches)
        except Exception as error:  # any compiler failure means "not this path"
            logger.warning("compiled path: compiling failed (%s)", error)
            return f"compiling failed: {error}"
        finally:
            for pool, contents in saved:
                pool[:touched].copy_(contents)
        logger.info("compiled path: decode step compiled in %.1f s", time.perf_counter() - start)
        return None


def _options(one_graph: bool) -> dict[str, object]:
    """Inductor's options: no checks of the inputs' sizes and strides in the generated code
    (~110 calls, 0.07 ms of a one-row step; the guards already check the batch, and the
    model's tensors never change), and with one graph, no guards on the model."""
    options: dict[str, object] = {"size_asserts": False}
    if one_graph:
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
    return options


def _decode_forward(model: nn.Module, batch: ForwardBatch, caches: StateCaches) -> torch.Tensor:
    return model(batch, caches)


def _own_copy(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`function` with a code object of its own, so that the graphs compiled for it are not
    shared with any other copy (see the module's docstring)."""
    code = function.__code__.replace()
    return types.FunctionType(code, function.__globals__, function.__name__)


def _pools(caches: StateCaches) -> list[torch.Tensor]:
    return list(caches.pools().values())


def _warm_up_batch(rows: int, caches: StateCaches) -> ForwardBatch:
    """`rows` decode rows at position 1, each with slot i, KV slot i and the block table
    [0, 0] (two columns: the runner's narrowest table)."""
    device = next(iter(_pools(caches))).device

    def ints(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return ForwardBatch(
        input_ids=ints([0] * rows),
        positions=ints([1] * rows),
        slot_mapping=ints(list(range(rows))),
        num_decode=rows,
        block_tables=ints([[0, 0]] * rows),
        seq_lens=ints([2] * rows),
        state_slots=ints(list(range(rows))),
        prefill_cu_seqlens=ints([0]),
        prefill_initial_slots=ints([]),
        logits_indices=ints(list(range(rows))),
    )
