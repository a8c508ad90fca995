"""What an architecture adapter provides: config parsing and checkpoint weight names.

Internal parameter names come from `HybridForCausalLM` (`layers.{j}.op.in_proj.weight`, ...).
An adapter says, for each internal name, which checkpoint tensors fill it: a list of
alternatives (e.g. `backbone.*` or `model.*` prefixes, per-expert or fused expert tensors), each
a list of `WeightSource`s that together make up the full (unsharded) parameter.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridserve.workers.models.config import (
    AttentionSpec,
    ConfigReader,
    GatedDeltaNetSpec,
    HybridModelConfig,
    MambaSpec,
    RopeSpec,
)


@dataclass(frozen=True)
class WeightSource:
    key: str
    # Where this tensor goes in the full parameter: an index along dim 0 (an expert id, a row
    # range when separate projections fill one fused matrix, a tensor of destination rows when
    # a fused checkpoint tensor's rows are interleaved differently), or a tuple of them for the
    # leading dims; None = the whole parameter.
    index: int | slice | torch.Tensor | tuple[int | slice, ...] | None = None
    # Applied to the checkpoint tensor before it is cast to the parameter's dtype (e.g. a
    # zero-centred norm's w -> 1 + w in float32).
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None


Alternatives = list[list[WeightSource]]


@dataclass(frozen=True)
class ModelFamily:
    """A family of checkpoints an adapter serves: a row of the README's support table
    (`hybridserve.workers.support_table`). Each variant is a checkpoint form worth telling
    apart (dense, MoE), as a `model_type` and overrides of transformers' default config for
    it (with MTP layers where the family ships them); the table parses each with the adapter
    and asks every forward path whether it serves the result."""

    name: str
    model_types: tuple[str, ...]
    variants: tuple[tuple[str, str, dict[str, Any]], ...]


class ArchitectureAdapter(Protocol):
    model_types: tuple[str, ...]
    families: tuple[ModelFamily, ...]
    # Checkpoint tensors we knowingly do not use (e.g. multi-token-prediction heads).
    ignored_keys: re.Pattern[str] | None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig: ...

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives: ...


# Internal Mamba mixer parameter -> its name inside an HF mixer module.
MAMBA_RENAMES = {
    "conv_weight": "conv1d.weight",
    "conv_bias": "conv1d.bias",
    "norm_weight": "norm.weight",
}

LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
# A multi-token-prediction sublayer's internal name (after "mtp."): step, sublayer, rest.
MTP_LAYER_NAME = re.compile(r"steps\.(\d+)\.(\d+)\.(.+)")


def single(key: str) -> Alternatives:
    return [[WeightSource(key)]]


def model_sources(name: str, *, embed: str, final_norm: str) -> Alternatives | None:
    """The checkpoint tensors of the model's own parameters (embedding, final norm, LM head),
    for formats that keep them as `{embed}`, `{final_norm}` and `lm_head.weight`; None for a
    layer's parameter."""
    keys = {"embed.weight": embed, "final_norm.weight": final_norm, "lm_head": "lm_head.weight"}
    return single(keys[name]) if name in keys else None


def split_layer_name(name: str, sublayers: int = 2) -> tuple[int, int, str]:
    """`layers.{j}.{rest}` of a format whose decoder layers are `sublayers` of ours each ->
    (its layer index, which of the layer's sublayers, rest)."""
    match = LAYER_NAME.fullmatch(name)
    assert match is not None, name
    index = int(match[1])
    return index // sublayers, index % sublayers, match[2]


def mamba_key(prefix: str, param: str) -> str:
    return f"{prefix}.{MAMBA_RENAMES.get(param, param)}"


def gate_and_up(
    gate: str,
    up: str,
    size: int,
    expert: int | None = None,
    gate_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[WeightSource]:
    """A gated MLP's fused [gate | up] rows (`size` each) from the checkpoint's two tensors,
    as expert `expert`'s where given."""
    lead: tuple[int, ...] = () if expert is None else (expert,)
    return [
        WeightSource(gate, (*lead, slice(0, size)), gate_transform),
        WeightSource(up, (*lead, slice(size, 2 * size))),
    ]


def stacked_experts(prefix: str, fused: str, per_expert: str, num_experts: int) -> Alternatives:
    """Routed experts stored either as one 3-D tensor or as one 2-D tensor per expert."""
    return [
        [WeightSource(f"{prefix}.{fused}")],
        [WeightSource(f"{prefix}.{e}.{per_expert}", e) for e in range(num_experts)],
    ]


def stacked_gate_up(prefix: str, gate: str, up: str, num_experts: int, size: int) -> Alternatives:
    """Routed experts' fused [gate | up] rows (`size` each): stacked as transformers holds them
    (`{prefix}.gate_up_proj`), or each expert's `{prefix}.{e}.{gate}` and `{prefix}.{e}.{up}`."""
    per_expert = [
        source
        for e in range(num_experts)
        for source in gate_and_up(f"{prefix}.{e}.{gate}", f"{prefix}.{e}.{up}", size, e)
    ]
    return [[WeightSource(f"{prefix}.gate_up_proj")], per_expert]


@dataclass(frozen=True)
class FfnNames:
    """Where a checkpoint format keeps a feed-forward block's tensors, relative to the block:
    a dense MLP's, and a routed MoE's (router, its score bias, experts, shared expert)."""

    gate: str = "gate_proj.weight"
    up: str = "up_proj.weight"
    down: str = "down_proj.weight"
    router: str = "gate.weight"
    score_bias: str | None = None
    experts: str = "experts"
    expert_gate: str = "gate_proj.weight"
    expert_up: str = "up_proj.weight"
    expert_down: str = "down_proj.weight"
    shared: str | None = None  # the shared expert's module (with gate / up / down as above)
    shared_gate: str | None = None


def ffn_sources(config: HybridModelConfig, ffn: str, param: str, names: FfnNames) -> Alternatives:
    """An FFN sublayer's parameter (`gate_up_proj.weight`, `router.weight`, `experts.up`,
    ...) in a format that names its tensors `names`, under the block `ffn`."""
    if param in ("gate_up_proj.weight", "shared.gate_up_proj.weight"):
        mlp = config.mlp if param == "gate_up_proj.weight" else config.moe and config.moe.shared
        assert mlp is not None
        owner = ffn if param == "gate_up_proj.weight" else f"{ffn}.{names.shared}"
        size = mlp.intermediate_size
        return [gate_and_up(f"{owner}.{names.gate}", f"{owner}.{names.up}", size)]
    if param == "down_proj.weight":
        return single(f"{ffn}.{names.down}")
    if param == "shared.down_proj.weight":
        return single(f"{ffn}.{names.shared}.{names.down}")
    moe = config.moe
    assert moe is not None
    named = {
        "router.weight": names.router,
        "router.score_bias": names.score_bias,
        "shared_gate.weight": names.shared_gate,
    }
    if param in named:
        return single(f"{ffn}.{named[param]}")
    experts = f"{ffn}.{names.experts}"
    if param == "experts.up":
        gate, up = names.expert_gate, names.expert_up
        return stacked_gate_up(experts, gate, up, moe.num_experts, moe.intermediate_size)
    assert param == "experts.down", param
    return stacked_experts(experts, "down_proj", names.expert_down, moe.num_experts)


def check_mamba(
    reader: ConfigReader,
    spec: MambaSpec,
    *,
    heads_field: str,
    groups_field: str,
    activation_field: str,
) -> None:
    if spec.num_heads % spec.n_groups:
        raise reader.error(
            groups_field, f"{spec.n_groups} groups do not divide {heads_field}={spec.num_heads}"
        )
    if spec.activation != "silu":
        raise reader.error(
            activation_field, f"the Mamba conv activation must be silu, got {spec.activation!r}"
        )


def gated_deltanet_spec(
    reader: ConfigReader, norm_eps: float, beta_scale: float = 1.0
) -> GatedDeltaNetSpec:
    """The `linear_*` fields of the Gated DeltaNet families (Qwen3-Next, Qwen3.5, OLMo-Hybrid)."""
    spec = GatedDeltaNetSpec(
        num_key_heads=reader.int("linear_num_key_heads"),
        num_value_heads=reader.int("linear_num_value_heads"),
        key_head_dim=reader.int("linear_key_head_dim"),
        value_head_dim=reader.int("linear_value_head_dim"),
        conv_kernel=reader.int("linear_conv_kernel_dim", 4, minimum=2),
        norm_eps=norm_eps,
        beta_scale=beta_scale,
    )
    if spec.num_value_heads % spec.num_key_heads:
        raise reader.error(
            "linear_num_value_heads",
            f"{spec.num_value_heads} is not a multiple of linear_num_key_heads="
            f"{spec.num_key_heads}",
        )
    return spec


def attention_spec(
    reader: ConfigReader,
    hidden: int,
    *,
    bias: bool,
    rope_partial: float | None,
    scale: float | None = None,
) -> AttentionSpec:
    """Attention geometry; `rope_partial` is the default rotary fraction, None for no RoPE."""
    heads = reader.int("num_attention_heads")
    kv_heads = reader.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise reader.error(
            "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads={heads}"
        )
    head_dim = reader.int("head_dim", hidden // heads, aliases=("attention_head_dim",))
    rope = None if rope_partial is None else rope_spec(reader, head_dim, rope_partial)
    return AttentionSpec(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        bias=bias,
        scale=head_dim**-0.5 if scale is None else scale,
        rope=rope,
    )


def rope_spec(reader: ConfigReader, head_dim: int, default_partial: float) -> RopeSpec:
    """RoPE from `rope_parameters` (current) or top-level `rope_theta` / `rope_scaling` (legacy)."""
    params = reader.raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise reader.error("rope_parameters", f"expected an object, got {params!r}")
    scaling = reader.raw.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise reader.error("rope_scaling", f"expected an object, got {scaling!r}")
    rope_type = params.get("rope_type", params.get("type", scaling.get("rope_type", "default")))
    if rope_type != "default":
        raise reader.error(
            "rope_parameters.rope_type", f"unsupported rope type {rope_type!r} (supported: default)"
        )
    theta = params.get("rope_theta", reader.raw.get("rope_theta", 10000.0))
    partial = params.get(
        "partial_rotary_factor", reader.raw.get("partial_rotary_factor", default_partial)
    )
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise reader.error(
            "rope_parameters.rope_theta", f"expected a positive number, got {theta!r}"
        )
    if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise reader.error(
            "rope_parameters.partial_rotary_factor", f"expected a number in (0, 1], got {partial!r}"
        )
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise reader.error(
            "rope_parameters.partial_rotary_factor",
            f"gives an odd rotary dimension {rotary_dim} for head_dim {head_dim}",
        )
    return RopeSpec(theta=float(theta), rotary_dim=rotary_dim)
