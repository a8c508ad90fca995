"""The compiled decode step: decode-only batches through `torch.compile`.

An eager decode step at one request spends more time in its ~1,400 small tensor ops (norms,
conv and state updates, gating, residual adds, views and casts) and their Python dispatch than
in its GEMMs. Compiled, the ops between two GEMMs fuse into one generated loop (C++ on the CPU,
Triton on CUDA) and the step is one call.

What the compiler traces differs from the eager step in three places, each behind
`torch.compiler.is_compiling()`:
- Mamba states and KV blocks are written through (pool, layer), not per-layer views
  (`kernels.reference.pooled`): a write through a view of a graph input would copy the whole
  pool back every step.
- Packed CPU GEMMs are one opaque operator (`packed_linear`), and so are the SSM state
  update (`ssm_update_`: the compiler's own loop writes the new states to a temporary and
  copies them back, twice the traffic) and the decode attention (`attention_decode`: the
  traced reference gathers every row's keys and values before attending), when their C++
  implementations are built (kernels/cpu_ops.py). Else the compiler traces torch code.
- The dispatched kernels trace their torch reference; the compiler generates the kernel.

Shapes are dynamic: one graph serves every batch of two or more rows and every block-table
width (the runner pads tables to two columns at least, since the compiler specialises a size
of 1); one row gets a graph of its own. Both compile at engine start (`warm_up`), so no request
waits for the compiler; inductor's on-disk cache makes later starts quick. That holds because
the tracer does no duck shaping: by default it gives sizes that happen to be equal in the
traced batch one symbol, and the warm-up's table width (2) equalled the KV pool's K/V
dimension, so the first request longer than two blocks recompiled the step (12 s). Mixed and
prefill steps stay eager. When the warm-up fails (no C++ compiler, say), the engine logs why
and runs every step eagerly.

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

from hybridserve.kernels import cpu_ops
from hybridserve.kernels.dispatch import kernel_backend
from hybridserve.workers.forward_batch import ForwardBatch, StateCaches
from hybridserve.workers.layers.moe import MoE

logger = logging.getLogger(__name__)

# Every dynamic size its own symbol (see the module's docstring). Made once: a patch object
# may be entered again and again, and making one costs ~20 us (it defines a class).
_TRACING_CONFIG = torch.fx.experimental._config.patch(use_duck_shape=False)
# Rows of the warm-up batches: one, and the first size of the dynamic graph.
WARM_UP_ROWS = (1, 2)


class CompiledDecode:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
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
        self.enabled = True
        self.num_compiled_steps = 0  # decode steps the compiled graphs ran (warm-up excluded)

    def __call__(self, batch: ForwardBatch, caches: StateCaches) -> torch.Tensor:
        """Final-normed hidden states of a decode-only batch (as `model(batch, caches)`)."""
        assert batch.num_decode == batch.num_tokens, "the compiled step runs decode rows only"
        if not self.enabled:
            return self.model(batch, caches)
        self.num_compiled_steps += 1
        with _TRACING_CONFIG:
            return self.compiled(self.model, batch, caches)

    @torch.inference_mode()
    def warm_up(self, caches: StateCaches, max_rows: int) -> None:
        """Compile both graphs with batches on the first slots and blocks; their contents are
        put back afterwards. With `max_rows` 1 only the one-row graph is compiled."""
        if kernel_backend(next(iter(_pools(caches)))) == "cpu":
            # Before tracing: the tracer only reads whether they are built.
            cpu_ops.build()
        touched = max(WARM_UP_ROWS)  # slots (and at most blocks) the warm-up writes
        saved = [(pool, pool[:touched].clone()) for pool in _pools(caches)]
        start = time.perf_counter()
        try:
            with _TRACING_CONFIG:
                for rows in WARM_UP_ROWS:
                    if rows <= max_rows:
                        self.compiled(self.model, _warm_up_batch(rows, caches), caches)
        except Exception as error:  # any compiler failure means "stay eager"
            self.enabled = False
            logger.warning("compile_decode: compiling failed, decode runs eagerly (%s)", error)
        else:
            seconds = time.perf_counter() - start
            logger.info("compile_decode: decode step compiled in %.1f s", seconds)
        finally:
            for pool, contents in saved:
                pool[:touched].copy_(contents)


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
    return [pool for pool in (caches.kv, caches.conv, caches.ssm) if pool is not None]


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
        mamba_slots=ints(list(range(rows))),
        prefill_cu_seqlens=ints([0]),
        prefill_initial_slots=ints([]),
        logits_indices=ints(list(range(rows))),
    )
