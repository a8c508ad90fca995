"""Jamba: Mamba1 and attention mixers, each followed by a dense MLP or a routed MoE.

Layer i's mixer is attention where i % attn_layer_period == attn_layer_offset, else Mamba1
(layers/mamba1_mixer.py); its FFN is the MoE where i % expert_layer_period ==
expert_layer_offset (and num_experts > 1), else the MLP. Attention has no positional encoding
at all (the Mamba layers carry position). Both sublayers are pre-norm (`input_layernorm`,
`pre_ff_layernorm`); the final norm is `final_layernorm`.

The router takes the top k of the softmax over every expert, its weights left as they are
(not renormalised over the k). Experts are stored one tensor per expert in the checkpoint
(`experts.{e}.gate_proj`, ...) or stacked as transformers holds them in memory.
"""

from __future__ import annotations

import math

from hybridserve.workers.models.adapter import (
    Alternatives,
    FfnNames,
    ModelFamily,
    attention_spec,
    ffn_sources,
    model_sources,
    single,
    split_layer_name,
)
from hybridserve.workers.models.config import (
    ConfigReader,
    HybridModelConfig,
    LayerKind,
    Mamba1Spec,
    MLPSpec,
    MoESpec,
)

_FFN = FfnNames(router="router.weight")
_MAMBA_RENAMES = {
    "conv_weight": "conv1d.weight",
    "conv_bias": "conv1d.bias",
    "dt_norm.weight": "dt_layernorm.weight",
    "B_norm.weight": "b_layernorm.weight",
    "C_norm.weight": "c_layernorm.weight",
    "dt_bias": "dt_proj.bias",
}


def _periodic(
    reader: ConfigReader, period_field: str, offset_field: str, default: tuple[int, int]
) -> list[bool]:
    """The layers i with i % period == offset."""
    period = reader.int(period_field, default[0])
    offset = reader.int(offset_field, default[1], minimum=0)
    if offset >= period:
        raise reader.error(offset_field, f"{offset} must be smaller than {period_field}={period}")
    return [i % period == offset for i in range(reader.int("num_hidden_layers"))]


class JambaAdapter:
    model_types = ("jamba",)
    families = (
        ModelFamily(
            "Jamba",
            model_types,
            # transformers' default is Jamba-v0.1's layout: attention every 8th layer, MoE
            # every other one.
            (("MoE", "jamba", {}),),
        ),
    )
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-6, positive=True)
        attention = _periodic(reader, "attn_layer_period", "attn_layer_offset", (8, 4))
        routed = _periodic(reader, "expert_layer_period", "expert_layer_offset", (2, 1))
        num_experts = reader.int("num_experts", 16, aliases=("num_local_experts",))
        mixers: list[LayerKind] = ["attention" if a else "mamba1" for a in attention]
        ffns: list[LayerKind] = ["moe" if r and num_experts > 1 else "mlp" for r in routed]
        activation = reader.activation("hidden_act", "silu")
        if activation != "silu":
            raise reader.error("hidden_act", f"Jamba's Mamba layers use silu, got {activation!r}")
        intermediate = reader.int("intermediate_size")
        return HybridModelConfig(
            architecture="jamba",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(k for pair in zip(mixers, ffns, strict=True) for k in pair),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 262144),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            mamba1=self._mamba(reader, hidden, eps) if "mamba1" in mixers else None,
            attention=(
                attention_spec(reader, hidden, bias=False, rope_partial=None)
                if "attention" in mixers
                else None
            ),
            mlp=(
                MLPSpec(intermediate_size=intermediate, activation="silu", gated=True, bias=False)
                if "mlp" in ffns
                else None
            ),
            moe=self._moe(reader, num_experts, intermediate) if "moe" in ffns else None,
        )

    @staticmethod
    def _mamba(reader: ConfigReader, hidden: int, eps: float) -> Mamba1Spec:
        dt_rank = reader.raw.get("mamba_dt_rank", "auto")
        return Mamba1Spec(
            intermediate_size=reader.int("mamba_expand", 2) * hidden,
            state_size=reader.int("mamba_d_state", 16),
            dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else reader.int("mamba_dt_rank"),
            conv_kernel=reader.int("mamba_d_conv", 4, minimum=2),
            conv_bias=reader.bool("mamba_conv_bias", True),
            proj_bias=reader.bool("mamba_proj_bias", False),
            norm_eps=eps,
        )

    @staticmethod
    def _moe(reader: ConfigReader, num_experts: int, intermediate: int) -> MoESpec:
        top_k = reader.int("num_experts_per_tok", 2)
        if top_k > num_experts:
            raise reader.error(
                "num_experts_per_tok", f"{top_k} is more than num_experts={num_experts}"
            )
        return MoESpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=intermediate,
            activation="silu",
            gated=True,
            router="softmax_topk",
            norm_topk_prob=False,
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(
            name, embed="model.embed_tokens.weight", final_norm="model.final_layernorm.weight"
        )
        if own is not None:
            return own
        index, is_ffn, rest = split_layer_name(name)
        layer = f"model.layers.{index}"
        if rest == "norm.weight":
            return single(f"{layer}.{'pre_ff_layernorm' if is_ffn else 'input_layernorm'}.weight")
        param = rest.removeprefix("op.")
        if is_ffn:
            return ffn_sources(config, f"{layer}.feed_forward", param, _FFN)
        if config.layer_kinds[2 * index] == "attention":
            return single(f"{layer}.self_attn.{param}")
        return single(f"{layer}.mamba.{_MAMBA_RENAMES.get(param, param)}")
