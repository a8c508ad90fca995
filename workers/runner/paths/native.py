"""The native path: small decode steps on the CPU as one C call (csrc/decode_step.c).

It accepts a step of up to MAX_ROWS (8) rows that continue from live slots: decode rows (as
many requests generating) and the chunks of speculative decoding's verify steps, whose rows
advance their request's state one after the other, exactly as that many decode steps would.
The call returns every row's logits, the LM head included, and its argmax (the greedy token:
a step of plain greedy rows needs no sampler). Every other step goes to the next path. The C kernel
gets the model once, as a table of weight pointers and sizes built from the loaded modules,
and the pools' addresses and strides; a step passes each row's token, context length, block
table and state slot.

It applies to fp32 models on the CPU at tensor_parallel_size 1 whose layers are Mamba2 (each
way its gate meets its norm), Gated DeltaNet, short convolutions (LFM2), attention (with or
without RoPE, gated or not, q/k norms per head or over all heads) and dense MLPs, each pre-norm
or post-norm (OLMo), after the one before or beside it (Falcon-H1); `unsupported` and
`prepare` say why not otherwise (MoE layers, say). The tests compare it with the model's eager
step on the same states (tests/workers/runner/paths/test_native.py), and every
engine test that decodes up to eight requests at a time runs it against transformers.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hybridserve.kernels.cpu import decode_step as cpu_decode_step
from hybridserve.kernels.cpu.decode_step import Layer, Linear, Model, Step
from hybridserve.kernels.cpu.gemm import GEMV_ROWS
from hybridserve.kernels.dispatch import BACKEND_ENV, cpu_kernel
from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.layers.attention import Attention
from hybridserve.workers.layers.gated_deltanet import GatedDeltaNet
from hybridserve.workers.layers.linear import PackableLinear
from hybridserve.workers.layers.mamba_mixer import MambaMixer
from hybridserve.workers.layers.mlp import MLP
from hybridserve.workers.layers.norm import SplitRMSNorm
from hybridserve.workers.layers.short_conv import ShortConv
from hybridserve.workers.models.config import HybridModelConfig, LayerKind
from hybridserve.workers.models.hybrid import HybridForCausalLM
from hybridserve.workers.runner.forward_batch import StateCaches
from hybridserve.workers.runner.model_runner import RunnerOutput
from hybridserve.workers.runner.paths.base import ForwardPath
from hybridserve.workers.runner.sampler import greedy_samples, is_plain_greedy
from hybridserve.workers.speculative.verification import settle

logger = logging.getLogger(__name__)

# Decode rows a native step takes: up to the C mat-vec's (beyond them oneDNN's packed GEMM, in
# the compiled or eager step, catches up with it).
MAX_ROWS = GEMV_ROWS


@dataclass(frozen=True, slots=True)
class NativeStep:
    """A native step's result, one row per decode row."""

    logits: torch.Tensor  # float32 (rows, vocab), as `compute_logits` gives them
    greedy_token_ids: list[int]  # each row's argmax, as torch.argmax picks it


class Unsupported(Exception):
    """Why the native step does not apply to a model or its pools."""


class NativePath(ForwardPath):
    name = "native"

    def unsupported(self) -> str | None:
        runner = self.runner
        if runner.device.type != "cpu":
            return f"not on the CPU ({runner.device})"
        if runner.parallel.tp_size != 1:
            return f"tensor_parallel_size {runner.parallel.tp_size}"
        if not isinstance(runner.model, HybridForCausalLM):
            return f"{type(runner.model).__name__} is not a hybrid model"
        if _decode_step_kernel() is None:
            return f"the C kernel did not build (no compiler, or {BACKEND_ENV})"
        return None

    def prepare(self) -> str | None:
        try:
            self._describe(self.runner.model, self.runner.caches)
        except Unsupported as reason:
            return str(reason)
        return None

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return sum(c.num_tokens for c in chunks) <= MAX_ROWS and all(_continues(c) for c in chunks)

    def run(self, chunks: list[ScheduledChunk]) -> RunnerOutput:
        """No batch tensors: the forward, the LM head and each row's argmax are one C call.
        Rows of plain greedy decoding (the usual case) take that argmax as their token.
        Whether they all are is settled before the call: after it, the interpreter runs from
        caches that the step's weights have just flushed, several times slower, so it builds
        their samples and nothing else."""
        ranges = []  # each chunk's (first, last) row
        for chunk in chunks:
            first = ranges[-1][1] + 1 if ranges else 0
            ranges.append((first, first + chunk.num_tokens - 1))
        order = list(range(len(chunks)))
        if all(
            c.sampling is not None and all(is_plain_greedy(row) for row in c.sampling_rows)
            for c in chunks
        ):
            tokens = self.step(chunks).greedy_token_ids
            output = RunnerOutput(
                [
                    settle(
                        greedy_samples(tokens[last - len(c.draft_rows) : last + 1]),
                        c.draft_token_ids,
                    )
                    for c, (_, last) in zip(chunks, ranges, strict=True)
                ]
            )
        else:
            output = self.runner.sample(chunks, order, self.step(chunks).logits, ranges)
        if self.runner.uses_mtp:
            hidden = self._normed[: ranges[-1][1] + 1].clone()
            self.runner.propose_with_mtp(chunks, order, output, hidden)
        return output

    def _describe(self, model: HybridForCausalLM, caches: StateCaches) -> None:
        """The model's and the pools' table for the C side; raises `Unsupported` (with the
        reason) where the kernel does not apply."""
        # The C side holds raw addresses of the weights and pools: both are kept, and both are
        # fixed once loaded and allocated.
        reason = native_unsupported(model.config)
        if reason is not None:
            raise Unsupported(reason)
        self.kernel = _decode_step_kernel()
        self._keep: list[torch.Tensor] = []  # tensors made here whose addresses the C side holds
        config = model.config
        self.vocab_size = model.lm_head_weight.shape[0]  # at tensor_parallel_size 1, unpadded
        layers = [self._layer(sublayer) for sublayer in model.layers]
        for i in model.parallel_layers:  # the layer before a parallel one keeps its input
            layers[i].parallel, layers[i - 1].keep_input = True, True
        self._layers = (Layer * len(layers))(*layers)
        projected = max((sum(linear.rows for linear in layer.in_) for layer in layers), default=1)
        mixed = max((_mixed_size(sublayer.op) for sublayer in model.layers), default=1)
        sizes = (config.hidden_size, config.hidden_size, projected, mixed, config.hidden_size)
        buffers = [torch.empty(MAX_ROWS * size, dtype=torch.float32) for size in sizes]
        self._keep += buffers
        scratch = [self._pointer(buffer) for buffer in buffers]
        # The rows' final-normed hidden states once a step is done (the LM head's input):
        # what MTP layers read.
        self._normed = buffers[1].view(MAX_ROWS, config.hidden_size)
        self.model_table = Model(
            num_layers=len(layers),
            hidden_size=config.hidden_size,
            layers=self._layers,
            embed=self._pointer(model.embed.weight),
            final_norm=self._pointer(model.final_norm.weight),
            lm_head=Linear(self._pointer(model.lm_head_weight), None, *model.lm_head_weight.shape),
            embedding_multiplier=config.embedding_multiplier,
            residual_multiplier=config.residual_multiplier,
            norm_eps=config.norm_eps,
            logits_divisor=config.logits_divisor,
            **_pool_fields(caches),
            hidden=scratch[0],
            normed=scratch[1],
            projected=scratch[2],
            mixed=scratch[3],
            projected_size=projected,
            mixed_size=mixed,
            layer_input=scratch[4],
        )
        self._model_pointer = ctypes.pointer(self.model_table)
        # A step's inputs, in buffers kept from step to step that the step's table points at
        # (building them anew cost ~0.1 ms a step); the block tables' buffer grows with the
        # longest table.
        self._tokens, self._seq_lens, self._slots = (np.zeros(MAX_ROWS, np.int64) for _ in range(3))
        self._tables = np.zeros((MAX_ROWS, 0), dtype=np.int64)
        self._lane_starts = np.zeros(MAX_ROWS + 1, np.int64)
        self._step = Step(
            0,
            self._seq_lens.ctypes.data,
            None,
            0,
            self._slots.ctypes.data,
            0,
            self._lane_starts.ctypes.data,
        )
        self._step_pointer = ctypes.pointer(self._step)
        self._tokens_address = self._tokens.ctypes.data
        self._greedy = np.zeros(MAX_ROWS, np.int64)
        self._greedy_address = self._greedy.ctypes.data
        self.num_steps = self.num_rows = 0  # steps run here, and their decode rows

    def step(self, chunks: list[ScheduledChunk]) -> NativeStep:
        """The logits of every token of `chunks` (up to MAX_ROWS in all, each chunk continuing
        from its live slot), in order, and their greedy tokens; their states and KV slots are
        written as that many decode steps would write them."""
        rows = sum(c.num_tokens for c in chunks)
        if not (1 <= rows <= MAX_ROWS and all(_continues(c) for c in chunks)):
            # The scratch holds MAX_ROWS rows: more would write past it.
            raise ValueError(
                f"a native step takes 1 to {MAX_ROWS} rows continuing from live slots, not {rows}"
            )
        width = max(len(c.block_ids) for c in chunks)
        if width > self._tables.shape[1]:
            self._tables = np.zeros((MAX_ROWS, 2 * width), dtype=np.int64)
            self._step.tables, self._step.width = self._tables.ctypes.data, 2 * width
        r = 0
        for lane, chunk in enumerate(chunks):
            self._lane_starts[lane] = r
            for offset, token in enumerate(chunk.token_ids):
                # A table's entries past its own length are stale: the kernel reads a row's
                # blocks up to its context only.
                self._tables[r, : len(chunk.block_ids)] = chunk.block_ids
                self._seq_lens[r], self._slots[r] = chunk.start + offset + 1, chunk.slot
                self._tokens[r] = token
                r += 1
        self._lane_starts[len(chunks)] = rows
        self._step.rows, self._step.lanes = rows, len(chunks)
        logits = torch.empty((rows, self.vocab_size), dtype=torch.float32)
        self.num_steps += 1
        self.num_rows += rows
        self.kernel(
            self._model_pointer,
            self._step_pointer,
            self._tokens_address,
            logits.data_ptr(),
            self._greedy_address,
        )
        return NativeStep(logits, self._greedy[:rows].tolist())

    # ---- the model's table ------------------------------------------------------------------

    def _pointer(self, tensor: torch.Tensor | None) -> ctypes._Pointer | None:
        """A float pointer to `tensor` (None for None); the tensor must outlive this object."""
        if tensor is None:
            return None
        if tensor.device.type != "cpu" or tensor.dtype != torch.float32:
            raise Unsupported(f"a {tensor.dtype} tensor on {tensor.device} (fp32 on the CPU only)")
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            self._keep.append(tensor)
        return ctypes.cast(tensor.data_ptr(), ctypes.POINTER(ctypes.c_float))

    def _linear(self, module: PackableLinear) -> Linear:
        """A linear layer's table: its float weight, or its FP8 bytes and scales."""
        weight, bias, scale = module.weight, module.bias, module.weight_scale
        rows, cols = weight.shape
        if scale is None:
            return Linear(self._pointer(weight), self._pointer(bias), rows, cols)
        if not (weight.is_contiguous() and scale.is_contiguous()):
            raise Unsupported("a non-contiguous FP8 weight")
        return Linear(
            None,
            self._pointer(bias),
            rows,
            cols,
            fp8=weight.data_ptr(),
            scale=self._pointer(scale),
            group=module.weight_group,
        )

    def _layer(self, sublayer: nn.Module) -> Layer:
        op = sublayer.op
        layer = Layer(
            cache_index=sublayer.cache_index,
            norm=self._pointer(sublayer.norm.weight),
            post_norm=sublayer.post_norm,
        )
        if isinstance(op, MambaMixer):
            spec = op.spec
            A = -torch.exp(op.A_log.float())  # as the model's step computes it
            self._keep.append(A)
            layer.kind = cpu_decode_step.KIND_MAMBA
            layer.in_[0] = self._linear(op.in_proj)
            layer.out = self._linear(op.out_proj)
            layer.conv_weight = self._pointer(op.conv_weight)
            layer.conv_bias = self._pointer(op.conv_bias)
            layer.dt_bias, layer.A, layer.D = (self._pointer(t) for t in (op.dt_bias, A, op.D))
            layer.gate_norm = self._pointer(op.norm_weight)
            layer.heads, layer.head_dim, layer.groups = op.num_heads, spec.head_dim, op.n_groups
            layer.state_size, layer.conv_kernel = spec.state_size, spec.conv_kernel
            layer.conv_silu = spec.activation == "silu"  # as the conv kernels read it
            layer.gate_eps, layer.dt_min, layer.dt_max = spec.norm_eps, spec.dt_min, spec.dt_max
            layer.gate_mode = cpu_decode_step.GATE_MODES[spec.gate]
        elif isinstance(op, GatedDeltaNet):
            spec = op.spec
            A = -torch.exp(op.A_log.float())  # as the model's step computes it
            self._keep.append(A)
            layer.kind = cpu_decode_step.KIND_GDN
            layer.in_[0], layer.in_[1] = self._linear(op.in_proj), self._linear(op.in_proj_ba)
            layer.out = self._linear(op.out_proj)
            layer.conv_weight, layer.conv_silu = self._pointer(op.conv_weight), True
            layer.dt_bias, layer.A = self._pointer(op.dt_bias), self._pointer(A)
            layer.gate_norm, layer.gate_eps = self._pointer(op.norm_weight), spec.norm_eps
            layer.key_heads, layer.value_heads = op.num_key_heads, op.num_value_heads
            layer.key_head_dim, layer.value_head_dim = spec.key_head_dim, spec.value_head_dim
            layer.conv_kernel, layer.beta_scale = spec.conv_kernel, spec.beta_scale
        elif isinstance(op, ShortConv):
            layer.kind = cpu_decode_step.KIND_SHORT_CONV
            layer.in_[0], layer.out = self._linear(op.in_proj), self._linear(op.out_proj)
            layer.conv_weight, layer.conv_bias = (
                self._pointer(op.conv_weight),
                self._pointer(op.conv_bias),
            )
            layer.conv_kernel, layer.conv_silu = op.spec.conv_kernel, False
        elif isinstance(op, Attention):
            layer.kind = cpu_decode_step.KIND_ATTENTION
            layer.output_gate = op.output_gate
            if op.q_norm is not None and op.k_norm is not None:
                layer.q_norm, layer.k_norm = (
                    self._pointer(n.weight) for n in (op.q_norm, op.k_norm)
                )
                layer.qk_eps = op.q_norm.eps
                layer.qk_norm_all_heads = isinstance(op.q_norm, SplitRMSNorm)
            for i, proj in enumerate((op.q_proj, op.k_proj, op.v_proj)):
                layer.in_[i] = self._linear(proj)
            layer.out = self._linear(op.o_proj)
            layer.q_heads, layer.kv_heads = op.num_heads, op.num_kv_heads
            layer.attention_head_dim, layer.scale = op.head_dim, op.scale
            if op.rope is not None:
                layer.cos, layer.sin = (
                    self._pointer(t) for t in (op.rope.cos_cache, op.rope.sin_cache)
                )
                layer.rotary_dim = op.rope.rotary_dim
        else:
            assert isinstance(op, MLP), op
            layer.kind = cpu_decode_step.KIND_MLP
            up = op.gate_up_proj if op.gated else op.up_proj
            layer.in_[0] = self._linear(up)
            layer.out = self._linear(op.down_proj)
            layer.gated = op.gated
            layer.activation = cpu_decode_step.ACTIVATIONS[op.activation]
        return layer


# The sublayer kinds the C step computes (kernels/cpu/csrc/decode_step.c).
NATIVE_LAYER_KINDS: frozenset[LayerKind] = frozenset(
    {"mamba2", "gdn", "short_conv", "attention", "mlp"}
)


def native_unsupported(config: HybridModelConfig) -> str | None:
    """Why the C step cannot compute this model, on any CPU (None: it can)."""
    kinds = sorted(set(config.layer_kinds) - NATIVE_LAYER_KINDS)
    if kinds:
        return f"{', '.join(kinds)} layers"
    if config.gdn is not None and config.gdn.per_channel_decay:
        return "Kimi Delta Attention layers (a decay per key channel)"
    if config.attention is not None and config.attention.latent is not None:
        return "latent attention layers"
    return None


def _continues(chunk: ScheduledChunk) -> bool:
    """Whether a chunk continues from its live slot and needs no prompt scores: a decode
    row, a verify chunk (its drafts), or a short chunk after reuse."""
    return chunk.start > 0 and chunk.prompt_logprobs is None


def _decode_step_kernel() -> ctypes._CFuncPtr | None:
    """The C step, through the dispatch table; None where it does not build (or the
    reference backend is forced)."""
    binding = cpu_kernel("decode_step")
    return binding() if binding is not None else None


def _mixed_size(op: nn.Module) -> int:
    """Floats of the mixer's inner values (kernels/cpu/csrc/decode_step.c: `mixed`)."""
    if isinstance(op, MambaMixer):
        return 2 * op.intermediate + 2 * op.group_state  # x B C convolved | y
    if isinstance(op, GatedDeltaNet):
        return op.conv_dim + op.value_dim  # q k v convolved | y
    if isinstance(op, ShortConv):
        return op.channels  # convolved, then gated
    if isinstance(op, Attention):
        return op.num_heads * op.head_dim
    if isinstance(op, MLP):
        return op.down_proj.weight.shape[1]
    return 1


def _pool_fields(caches: StateCaches) -> dict[str, object]:
    """The pools' addresses and strides (in floats) as the kernel reads them; each (slot,
    layer) state and each block's (Hkv, block_size, D) must be contiguous fp32 on the CPU."""
    fields: dict[str, object] = {}
    float_p = ctypes.POINTER(ctypes.c_float)
    # The recurrent kind's conv window and its recurrent state (Mamba2's ssm, Gated DeltaNet's
    # recurrent), by the names the kernel reads them under.
    kernel_names = {"kv": "kv", "conv": "conv", "ssm": "state", "recurrent": "state"}
    pools = {kernel_names[name]: pool for name, pool in caches.pools().items()}
    for name, pool in pools.items():
        if pool.device.type != "cpu" or pool.dtype != torch.float32:
            raise Unsupported(f"the {name} pool is {pool.dtype} on {pool.device}")
        inner = pool[0, 0, 0] if name == "kv" else pool[0, 0]
        if not inner.is_contiguous():
            raise Unsupported(f"the {name} pool's states are not contiguous")
        fields[f"{name}_pool"] = ctypes.cast(pool.data_ptr(), float_p)
    for name in ("conv", "state"):
        if name in pools:
            strides = pools[name].stride()
            fields[f"{name}_slot_stride"], fields[f"{name}_layer_stride"] = strides[:2]
    if caches.kv is not None:
        kv = caches.kv
        fields["kv_block_stride"], fields["kv_layer_stride"] = kv.stride()[:2]
        fields["kv_value_offset"], fields["block_size"] = kv.stride(2), kv.shape[4]
    return fields
