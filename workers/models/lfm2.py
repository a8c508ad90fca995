"""LFM2 and LFM2-MoE: gated short convolutions with attention, each followed by a SwiGLU FFN.

Each decoder layer is a mixer (`conv`: the gated short convolution, layers/short_conv.py;
`full_attention`: attention with per-head q/k RMSNorms and RoPE over the whole head) then a
feed-forward block, both pre-norm (`operator_norm`, `ffn_norm`); each becomes two sublayers.
The final norm is called `embedding_norm`. Layer types come from `layer_types` or, in older
configs, `full_attn_idxs`.

LFM2's FFN size is derived from the config as transformers does: with
`block_auto_adjust_ff_dim`, 2/3 of `intermediate_size` (alias `block_ff_dim`), times
`block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of`.
LFM2-MoE's first `num_dense_layers` FFNs are dense (`intermediate_size` as given), the rest
route each token to `num_experts_per_tok` of `num_experts` by sigmoid scores plus a learned
per-expert bias (chosen by score + bias, weighted by score, renormalised with epsilon 1e-6).
"""

from __future__ import annotations

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
    MLPSpec,
    MoESpec,
    ShortConvSpec,
    parse_layer_names,
)

_MIXERS: dict[str, LayerKind] = {"conv": "short_conv", "full_attention": "attention"}
_FFN = FfnNames(
    gate="w1.weight",
    up="w3.weight",
    down="w2.weight",
    score_bias="expert_bias",
    expert_gate="w1.weight",
    expert_up="w3.weight",
    expert_down="w2.weight",
)
_ATTENTION_RENAMES = {
    "o_proj.weight": "out_proj.weight",
    "q_norm.weight": "q_layernorm.weight",
    "k_norm.weight": "k_layernorm.weight",
}


def _layout(layers: int, attention: list[int]) -> list[str]:
    return ["full_attention" if i in attention else "conv" for i in range(layers)]


class Lfm2Adapter:
    model_types = ("lfm2", "lfm2_moe")
    families = (
        ModelFamily(
            "LFM2 (and LFM2-MoE)",
            model_types,
            # transformers' defaults make every layer attention: the published layouts
            # (LFM2-1.2B, LFM2-8B-A1B) instead.
            (
                (
                    "dense",
                    "lfm2",
                    {"num_hidden_layers": 16, "full_attn_idxs": [2, 5, 8, 10, 12, 14]},
                ),
                (
                    "MoE",
                    "lfm2_moe",
                    {"num_hidden_layers": 24, "layer_types": _layout(24, [2, 6, 10, 14, 18, 21])},
                ),
            ),
        ),
    )
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        moe_model = reader.raw["model_type"] == "lfm2_moe"
        mixers = self._mixers(reader)
        hidden = reader.int("hidden_size")
        eps = reader.float("norm_eps", 1e-5, positive=True)
        ffns: list[LayerKind] = ["mlp"] * len(mixers)
        if moe_model:
            dense = reader.int("num_dense_layers", 2, minimum=0)
            ffns = ["mlp" if i < dense else "moe" for i in range(len(mixers))]
        attention = None
        if "attention" in mixers:
            spec = attention_spec(reader, hidden, bias=False, rope_partial=1.0)
            attention = spec.model_copy(update={"qk_norm_eps": eps})
        return HybridModelConfig(
            architecture="lfm2",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(k for pair in zip(mixers, ffns, strict=True) for k in pair),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 128_000),
            tie_word_embeddings=reader.bool(
                "tie_word_embeddings", True, aliases=("tie_embedding",)
            ),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            short_conv=(
                ShortConvSpec(
                    channels=hidden,
                    conv_kernel=reader.int("conv_L_cache", 3, minimum=2),
                    bias=reader.bool("conv_bias", False),
                )
                if "short_conv" in mixers
                else None
            ),
            attention=attention,
            mlp=(
                MLPSpec(
                    intermediate_size=self._ffn_size(reader, moe_model),
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
    def _mixers(reader: ConfigReader) -> list[LayerKind]:
        layers = reader.int("num_hidden_layers")
        if reader.has("layer_types"):
            allowed: set[LayerKind] = {"short_conv", "attention"}
            return parse_layer_names(reader, "layer_types", allowed, _MIXERS, counted=True)
        indices = reader.raw.get("full_attn_idxs")
        if indices is None:
            indices = list(range(layers))  # transformers' default: every layer attention
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and 0 <= i < layers for i in indices
        ):
            raise reader.error(
                "full_attn_idxs", f"expected layer indices below {layers}, got {indices!r}"
            )
        return ["attention" if i in indices else "short_conv" for i in range(layers)]

    @staticmethod
    def _ffn_size(reader: ConfigReader, moe_model: bool) -> int:
        size = reader.int("intermediate_size", aliases=("block_ff_dim",))
        if moe_model or not reader.bool("block_auto_adjust_ff_dim", True):
            return size
        size = int(2 * size / 3)
        # An explicit null skips the multiplier and the rounding (transformers does too).
        if reader.raw.get("block_ffn_dim_multiplier", 1.0) is not None:
            multiplier = reader.float("block_ffn_dim_multiplier", 1.0, positive=True)
            multiple = reader.int("block_multiple_of", 256)
            size = int(multiplier * size)
            size = multiple * ((size + multiple - 1) // multiple)
        return size

    @staticmethod
    def _moe(reader: ConfigReader) -> MoESpec:
        num_experts = reader.int("num_experts")
        top_k = reader.int("num_experts_per_tok")
        if top_k > num_experts:
            raise reader.error(
                "num_experts_per_tok", f"{top_k} is more than num_experts={num_experts}"
            )
        return MoESpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=reader.int("moe_intermediate_size"),
            activation="silu",
            gated=True,
            router="sigmoid_grouped",
            norm_topk_prob=reader.bool("norm_topk_prob", True),
            routed_scaling_factor=reader.float("routed_scaling_factor", 1.0),
            score_bias=reader.bool("use_expert_bias", True),
            topk_norm_eps=1e-6,
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(
            name, embed="model.embed_tokens.weight", final_norm="model.embedding_norm.weight"
        )
        if own is not None:
            return own
        index, is_ffn, rest = split_layer_name(name)
        layer = f"model.layers.{index}"
        if rest == "norm.weight":
            return single(f"{layer}.{'ffn_norm' if is_ffn else 'operator_norm'}.weight")
        param = rest.removeprefix("op.")
        if is_ffn:
            return ffn_sources(config, f"{layer}.feed_forward", param, _FFN)
        if config.layer_kinds[2 * index] == "attention":
            return single(f"{layer}.self_attn.{_ATTENTION_RENAMES.get(param, param)}")
        renames = {"conv_weight": "conv.weight", "conv_bias": "conv.bias"}
        return single(f"{layer}.conv.{renames.get(param, param)}")
