"""OLMo-Hybrid: Gated DeltaNet layers with OLMo's attention layers, each followed by a gated MLP.

The two layer types place their norms differently, and each becomes two sublayers here:

    linear_attention   x + gdn(input_layernorm(x)),  then  x + mlp(post_attention_layernorm(x))
    full_attention     x + post_attention_layernorm(attn(x)),  then
                       x + post_feedforward_layernorm(mlp(x))          (OLMo 2's post-norm)

The DeltaNet keeps separate q, k, v, g (our z), a and b projections, concatenated here into
in_proj q | k | v | z and in_proj_ba b | a; `linear_allow_neg_eigval` doubles beta. Its output
norm uses epsilon 1e-5 (flash-linear-attention's gated norm), not `rms_norm_eps`. Attention
normalises q and k over all heads at once (OLMo 2), has no output gate, and uses RoPE over the
whole head unless `rope_parameters` sets `rope_theta` to null, as the released checkpoints do
(NoPE).
"""

from __future__ import annotations

from hybridserve.workers.models.adapter import (
    Alternatives,
    ModelFamily,
    WeightSource,
    attention_spec,
    gate_and_up,
    gated_deltanet_spec,
    model_sources,
    single,
    split_layer_name,
)
from hybridserve.workers.models.config import (
    ConfigReader,
    HybridModelConfig,
    LayerKind,
    MLPSpec,
    parse_layer_names,
)

_MIXERS: dict[str, LayerKind] = {"linear_attention": "gdn", "full_attention": "attention"}
# Checkpoints keep OLMo-core's names for two norms (transformers renames them on load).
_SAVED_NORMS = {
    "attention_layer_norm": "input_layernorm",
    "feedforward_layer_norm": "post_attention_layernorm",
}
# flash-linear-attention's gated RMSNorm default, which the checkpoints were trained with.
_GATED_NORM_EPS = 1e-5


class OlmoHybridAdapter:
    model_types = ("olmo_hybrid",)
    families = (ModelFamily("OLMo-Hybrid", model_types, (("dense", "olmo_hybrid", {}),)),)
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        mixers = self._mixers(reader)
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-6, positive=True)
        if reader.activation("hidden_act", "silu") != "silu":
            raise reader.error(
                "hidden_act",
                f"must be silu (the MLP and the DeltaNet conv), got {reader.raw['hidden_act']!r}",
            )
        attention = None
        if "attention" in mixers:
            # NoPE where rope_parameters says rope_theta: null; a config without
            # rope_parameters gets transformers' default RoPE, as transformers loads it.
            rope = reader.raw.get("rope_parameters")
            has_rope = not (
                isinstance(rope, dict) and "rope_theta" in rope and rope["rope_theta"] is None
            )
            spec = attention_spec(
                reader,
                hidden,
                bias=reader.bool("attention_bias", False),
                rope_partial=1.0 if has_rope else None,
            )
            attention = spec.model_copy(update={"qk_norm_eps": eps, "qk_norm_scope": "all_heads"})
        neg_eigval = reader.bool("linear_allow_neg_eigval", True)
        post_norm = tuple(
            2 * i + j for i, kind in enumerate(mixers) if kind == "attention" for j in (0, 1)
        )
        return HybridModelConfig(
            architecture="olmo_hybrid",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(k for mixer in mixers for k in (mixer, "mlp")),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 65536),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            post_norm_layer_ids=post_norm,
            gdn=(
                gated_deltanet_spec(reader, _GATED_NORM_EPS, 2.0 if neg_eigval else 1.0)
                if "gdn" in mixers
                else None
            ),
            attention=attention,
            mlp=MLPSpec(
                intermediate_size=reader.int("intermediate_size"),
                activation="silu",
                gated=True,
                bias=False,
            ),
        )

    @staticmethod
    def _mixers(reader: ConfigReader) -> list[LayerKind]:
        return parse_layer_names(reader, "layer_types", {"gdn", "attention"}, _MIXERS, counted=True)

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(name, embed="model.embed_tokens.weight", final_norm="model.norm.weight")
        if own is not None:
            return own
        index, is_mlp, rest = split_layer_name(name)
        layer = f"model.layers.{index}"
        mixer = config.layer_kinds[2 * index]
        if rest == "norm.weight":
            norms = (
                ("post_attention_layernorm", "post_feedforward_layernorm")
                if mixer == "attention"
                else ("input_layernorm", "post_attention_layernorm")
            )
            norm = norms[is_mlp]
            names = [norm, *(k for k, v in _SAVED_NORMS.items() if v == norm)]
            return [[WeightSource(f"{layer}.{n}.weight")] for n in names]
        param = rest.removeprefix("op.")
        if is_mlp:
            if param == "gate_up_proj.weight":
                assert config.mlp is not None
                size = config.mlp.intermediate_size
                return [
                    gate_and_up(
                        f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight", size
                    )
                ]
            return single(f"{layer}.mlp.{param}")
        if mixer == "attention":
            return single(f"{layer}.self_attn.{param}")
        return self._gdn_sources(config, f"{layer}.linear_attn", param)

    @staticmethod
    def _gdn_sources(config: HybridModelConfig, mixer: str, param: str) -> Alternatives:
        spec = config.gdn
        assert spec is not None
        kd, vd, hv = spec.key_dim, spec.value_dim, spec.num_value_heads
        if param == "in_proj.weight":
            return [
                _stacked(mixer, [("q_proj", kd), ("k_proj", kd), ("v_proj", vd), ("g_proj", vd)])
            ]
        if param == "in_proj_ba.weight":
            return [_stacked(mixer, [("b_proj", hv), ("a_proj", hv)])]
        if param == "conv_weight":  # one conv (transformers) or one per q, k, v (checkpoints)
            per_input = [("q_conv1d", kd), ("k_conv1d", kd), ("v_conv1d", vd)]
            return [[WeightSource(f"{mixer}.conv1d.weight")], _stacked(mixer, per_input)]
        renames = {"norm_weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
        return single(f"{mixer}.{renames.get(param, param)}")


def _stacked(mixer: str, sections: list[tuple[str, int]]) -> list[WeightSource]:
    """Separate tensors `{mixer}.{name}.weight` of `rows` rows each, stacked in order."""
    sources, start = [], 0
    for name, rows in sections:
        sources.append(WeightSource(f"{mixer}.{name}.weight", slice(start, start + rows)))
        start += rows
    return sources
