"""Kimi Linear: Kimi Delta Attention and multi-head latent attention, each followed by a dense
MLP or a routed MoE with a shared expert.

Each decoder layer is a mixer then a feed-forward block, both pre-norm (`input_layernorm`,
`post_attention_layernorm`); each becomes two sublayers. The final norm is `model.norm`.

- Kimi Delta Attention (`linear_attention`) is the gated delta rule with a decay per key
  channel (GatedDeltaNetSpec.per_channel_decay, layers/gated_deltanet.py): q, k, v each with
  its own conv (`q_conv1d`, ...), low-rank forget (`f_a_proj`, `f_b_proj`) and output
  (`g_a_proj`, `g_b_proj`) gates of rank `linear_head_dim`, beta from `b_proj`.
- Full attention (`full_attention`) is latent attention without positional encoding
  (LatentKVSpec, layers/latent_attention.py): the cache holds each token's latent.
- The FFN (`block_sparse_moe` in the checkpoint, dense or not) routes with sigmoid scores plus
  a correction bias, group-limited, renormalised and scaled, beside its shared experts.

Layer kinds come from `layer_types` / `mlp_layer_types`, or the checkpoint's
`linear_attn_config` (1-indexed `full_attn_layers`, `kda_layers`) and `first_k_dense_replace`.
"""

from __future__ import annotations

from typing import Any

from hybridserve.workers.models.adapter import (
    Alternatives,
    FfnNames,
    ModelFamily,
    WeightSource,
    ffn_sources,
    model_sources,
    single,
    split_layer_name,
)
from hybridserve.workers.models.config import (
    AttentionSpec,
    ConfigReader,
    GatedDeltaNetSpec,
    HybridModelConfig,
    LatentKVSpec,
    LayerKind,
    MLPSpec,
    MoESpec,
    parse_layer_names,
)

_MIXERS: dict[str, LayerKind] = {"linear_attention": "gdn", "full_attention": "attention"}
_FFNS: dict[str, LayerKind] = {"dense": "mlp", "sparse": "moe"}
_FFN = FfnNames(
    score_bias="gate.e_score_correction_bias",
    expert_gate="w1.weight",
    expert_up="w3.weight",
    expert_down="w2.weight",
    shared="shared_experts",
)
_KDA_RENAMES = {
    "in_proj_ba.weight": "b_proj.weight",
    "gate.down.weight": "g_a_proj.weight",
    "gate.up.weight": "g_b_proj.weight",
    "forget.down.weight": "f_a_proj.weight",
    "forget.up.weight": "f_b_proj.weight",
    "norm_weight": "o_norm.weight",
    "out_proj.weight": "o_proj.weight",
    "dt_bias": "dt_bias",
}
_MLA_RENAMES = {
    "kv_a.weight": "kv_a_proj_with_mqa.weight",
    "kv_a.bias": "kv_a_proj_with_mqa.bias",
    "kv_norm.weight": "kv_a_layernorm.weight",
    "kv_b_weight": "kv_b_proj.weight",
    "q_a.weight": "q_a_proj.weight",
    "q_a.bias": "q_a_proj.bias",
    "q_norm.weight": "q_a_layernorm.weight",
    "q_b.weight": "q_b_proj.weight",
}


class KimiLinearAdapter:
    model_types = ("kimi_linear",)
    families = (
        ModelFamily(
            "Kimi Linear",
            model_types,
            # transformers' default is Kimi-Linear-48B-A3B's layout.
            (("MoE", "kimi_linear", {}),),
        ),
    )
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        linear = reader.raw.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise reader.error("linear_attn_config", f"expected an object, got {linear!r}")
        mixers, ffns = self._mixers(reader, linear), self._ffns(reader)
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-5, positive=True)
        if reader.activation("hidden_act", "silu") != "silu":
            raise reader.error("hidden_act", "Kimi Linear's convs and FFNs use silu")
        return HybridModelConfig(
            architecture="kimi_linear",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(k for pair in zip(mixers, ffns, strict=True) for k in pair),
            norm_eps=eps,
            max_position_embeddings=reader.int(
                "model_max_length", 1048576, aliases=("max_position_embeddings",)
            ),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            gdn=self._kda(reader, linear, eps) if "gdn" in mixers else None,
            attention=self._latent_attention(reader) if "attention" in mixers else None,
            mlp=(
                MLPSpec(
                    intermediate_size=reader.int("intermediate_size"),
                    activation="silu",
                    gated=True,
                    bias=False,
                )
                if "mlp" in ffns
                else None
            ),
            moe=self._moe(reader) if "moe" in ffns else None,
        )

    @staticmethod
    def _mixers(reader: ConfigReader, linear: dict[str, Any]) -> list[LayerKind]:
        layers = reader.int("num_hidden_layers")
        if reader.has("layer_types"):
            allowed: set[LayerKind] = {"gdn", "attention"}
            return parse_layer_names(reader, "layer_types", allowed, _MIXERS, counted=True)
        full, kda = linear.get("full_attn_layers"), linear.get("kda_layers")
        if full is None or kda is None:
            return ["attention" if i and i % 4 == 0 else "gdn" for i in range(layers)]
        numbers = sorted([*full, *kda]) if isinstance(full, list) and isinstance(kda, list) else []
        if numbers != list(range(1, layers + 1)):
            raise reader.error(
                "linear_attn_config",
                f"full_attn_layers and kda_layers must number the layers 1 .. {layers} once each",
            )
        return ["attention" if i + 1 in full else "gdn" for i in range(layers)]

    @staticmethod
    def _ffns(reader: ConfigReader) -> list[LayerKind]:
        if reader.has("mlp_layer_types"):
            allowed: set[LayerKind] = {"mlp", "moe"}
            return parse_layer_names(reader, "mlp_layer_types", allowed, _FFNS, counted=True)
        dense = reader.int("first_k_dense_replace", 1, minimum=0)
        return ["mlp" if i < dense else "moe" for i in range(reader.int("num_hidden_layers"))]

    @staticmethod
    def _kda(reader: ConfigReader, linear: dict[str, Any], eps: float) -> GatedDeltaNetSpec:
        def field(name: str, nested: str, default: int) -> int:
            value = linear.get(nested, reader.raw.get(name, default))
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise reader.error(name, f"expected a positive integer, got {value!r}")
            return value

        heads = field("linear_num_heads", "num_heads", 32)
        head_dim = field("linear_head_dim", "head_dim", 128)
        return GatedDeltaNetSpec(
            num_key_heads=heads,
            num_value_heads=heads,
            key_head_dim=head_dim,
            value_head_dim=head_dim,
            conv_kernel=max(2, field("linear_conv_kernel_dim", "short_conv_kernel_size", 4)),
            norm_eps=eps,
            per_channel_decay=True,
        )

    @staticmethod
    def _latent_attention(reader: ConfigReader) -> AttentionSpec:
        latent = LatentKVSpec(
            kv_lora_rank=reader.int("kv_lora_rank"),
            qk_nope_head_dim=reader.int("qk_nope_head_dim"),
            qk_rope_head_dim=reader.int("qk_rope_head_dim"),
            v_head_dim=reader.int("v_head_dim"),
            q_lora_rank=reader.int("q_lora_rank") if reader.has("q_lora_rank") else None,
            norm_eps=1e-6,  # transformers' default for the latent norms
        )
        qk_dim = latent.qk_nope_head_dim + latent.qk_rope_head_dim
        return AttentionSpec(
            num_heads=reader.int("num_attention_heads"),
            num_kv_heads=1,
            head_dim=latent.kv_lora_rank + latent.qk_rope_head_dim,
            bias=reader.bool("attention_bias", False),
            scale=qk_dim**-0.5,
            rope=None,  # Kimi Linear's latent attention has no positional encoding
            latent=latent,
        )

    @staticmethod
    def _moe(reader: ConfigReader) -> MoESpec:
        num_experts = reader.int("num_experts", aliases=("num_local_experts",))
        top_k = reader.int("num_experts_per_token", aliases=("num_experts_per_tok",))
        groups = reader.int("num_expert_group", 1, aliases=("n_group",))
        if top_k > num_experts or num_experts % groups:
            raise reader.error(
                "num_experts_per_token",
                f"{top_k} of {num_experts} experts in {groups} groups cannot be chosen",
            )
        size = reader.int("moe_intermediate_size")
        shared = reader.int("num_shared_experts", 1, minimum=0, aliases=("n_shared_experts",))
        return MoESpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=size,
            activation="silu",
            gated=True,
            router="sigmoid_grouped",
            num_expert_groups=groups,
            topk_groups=reader.int("topk_group", 1),
            norm_topk_prob=reader.bool("moe_renormalize", True, aliases=("norm_topk_prob",)),
            routed_scaling_factor=reader.float("routed_scaling_factor", 1.0),
            shared=(
                MLPSpec(intermediate_size=size * shared, activation="silu", gated=True, bias=False)
                if shared
                else None
            ),
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(name, embed="model.embed_tokens.weight", final_norm="model.norm.weight")
        if own is not None:
            return own
        index, is_ffn, rest = split_layer_name(name)
        layer = f"model.layers.{index}"
        if rest == "norm.weight":
            norm = "post_attention_layernorm" if is_ffn else "input_layernorm"
            return single(f"{layer}.{norm}.weight")
        param = rest.removeprefix("op.")
        if is_ffn:
            return ffn_sources(config, f"{layer}.block_sparse_moe", param, _FFN)
        mixer = f"{layer}.self_attn"
        if config.layer_kinds[2 * index] == "attention":
            return single(f"{mixer}.{_MLA_RENAMES.get(param, param)}")
        return self._kda_sources(config, mixer, param)

    @staticmethod
    def _kda_sources(config: HybridModelConfig, mixer: str, param: str) -> Alternatives:
        spec = config.gdn
        assert spec is not None
        width = spec.key_dim  # q, k and v are each heads x head_dim
        parts = ("q", "k", "v")
        if param == "in_proj.weight":
            return [
                [
                    WeightSource(f"{mixer}.{p}_proj.weight", slice(i * width, (i + 1) * width))
                    for i, p in enumerate(parts)
                ]
            ]
        if param == "conv_weight":
            return [
                [
                    WeightSource(f"{mixer}.{p}_conv1d.weight", slice(i * width, (i + 1) * width))
                    for i, p in enumerate(parts)
                ]
            ]
        if param == "A_log":  # stored (1, 1, heads, 1)
            return [[WeightSource(f"{mixer}.A_log", transform=lambda t: t.reshape(-1))]]
        return single(f"{mixer}.{_KDA_RENAMES[param]}")
