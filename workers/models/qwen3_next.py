"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet + gated attention hybrids.

Each decoder layer is a mixer (`linear_attention`: Gated DeltaNet; `full_attention`: gated
attention with zero-centred q/k norms and partial RoPE) followed by an FFN: a gated MLP, or a
softmax-routed MoE with a sigmoid-gated shared expert. Each becomes two sublayers here. Every
residual norm, the final norm and the q/k norms are zero-centred (weight 1 + w).

Checkpoint forms:
- Qwen3-Next (`qwen3_next`) fuses the DeltaNet projections per key head: `in_proj_qkvz` rows
  are [q_h | k_h | v of h's value heads | z of them] for each key head h, `in_proj_ba` rows
  [b | a] of h's value heads; the loader scatters them into our q | k | v | z | b | a rows.
  Its MoE layers are those not in `mlp_only_layers` with (index + 1) % decoder_sparse_step == 0.
- Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`) keeps `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
  `in_proj_a` apart; every FFN is an MLP (dense) or a MoE (`-moe`).
- Qwen3.5's image-text checkpoints (`qwen3_5`, `qwen3_5_moe`: `...ForConditionalGeneration`)
  nest the text model's config under `text_config` and its weights under
  `model.language_model.`; they are served as text models, the vision tower skipped by name.
Their multimodal RoPE, with every token's three position ids equal (text), is plain RoPE.
"""

from __future__ import annotations

import re

import torch

from hybridserve.workers.models.adapter import (
    LAYER_NAME,
    MTP_LAYER_NAME,
    Alternatives,
    FfnNames,
    ModelFamily,
    WeightSource,
    attention_spec,
    ffn_sources,
    gated_deltanet_spec,
    single,
)
from hybridserve.workers.models.config import (
    ConfigReader,
    GatedDeltaNetSpec,
    HybridModelConfig,
    LayerKind,
    MLPSpec,
    MoESpec,
    parse_layer_names,
)

_MIXERS: dict[str, LayerKind] = {"linear_attention": "gdn", "full_attention": "attention"}
# The model's own weights sit under either prefix (text checkpoints, image-text checkpoints).
_PREFIXES = ("model", "model.language_model")
_FFN = FfnNames(shared="shared_expert", shared_gate="shared_expert_gate.weight")
_ZERO_CENTRED = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm")


def _plus_one(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-centred norm's stored w -> the scale 1 + w, in float32."""
    return tensor.float() + 1.0


class Qwen3NextAdapter:
    model_types = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    families = (
        ModelFamily(
            "Qwen3-Next",
            ("qwen3_next",),
            (("MoE", "qwen3_next", {"num_nextn_predict_layers": 1}),),
        ),
        ModelFamily(
            "Qwen3.5 (text or image-text, served as text)",
            ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"),
            (
                ("dense", "qwen3_5_text", {"mtp_num_hidden_layers": 1}),
                ("MoE", "qwen3_5_moe_text", {"mtp_num_hidden_layers": 1}),
            ),
        ),
    )
    # The vision tower is not part of the text model; the multi-token-prediction layers
    # load only when speculative decoding uses them.
    ignored_keys = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        model_type = reader.raw["model_type"]
        text = reader
        tie_word_embeddings = reader.bool("tie_word_embeddings", False)
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            nested = reader.raw.get("text_config")
            if not isinstance(nested, dict):
                raise reader.error("text_config", f"expected an object, got {nested!r}")
            text = ConfigReader(nested, f"{reader.file} (text_config)")
            model_type = f"{model_type}_text"
        mixers = self._mixers(text)
        hidden = text.int("hidden_size")
        eps = text.float("rms_norm_eps", 1e-6, positive=True)
        activation = text.activation("hidden_act", "silu")
        if activation != "silu":
            raise text.error("hidden_act", f"must be silu for these models, got {activation!r}")
        ffns = self._ffns(text, model_type, len(mixers))
        # Multi-token prediction: a full-attention decoder layer per step (Qwen3.5:
        # mtp_num_hidden_layers; Qwen3-Next: num_nextn_predict_layers), its FFN the model's.
        num_mtp = text.int(
            "mtp_num_hidden_layers", 0, minimum=0, aliases=("num_nextn_predict_layers",)
        )
        mtp_kinds: tuple[LayerKind, ...] = ()
        if num_mtp:
            mtp_kinds = ("attention", "moe" if "moe" in ffns else "mlp")
        attention = None
        if "attention" in mixers or num_mtp:
            spec = attention_spec(
                text, hidden, bias=text.bool("attention_bias", False), rope_partial=0.25
            )
            attention = spec.model_copy(update={"output_gate": True, "qk_norm_eps": eps})
        return HybridModelConfig(
            architecture="qwen3_next" if model_type == "qwen3_next" else "qwen3_5",
            vocab_size=text.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(k for pair in zip(mixers, ffns, strict=True) for k in pair),
            norm_eps=eps,
            max_position_embeddings=text.int("max_position_embeddings", 32768),
            tie_word_embeddings=tie_word_embeddings or text.bool("tie_word_embeddings", False),
            bos_token_id=text.raw.get("bos_token_id"),
            eos_token_ids=text.token_ids("eos_token_id") or reader.token_ids("eos_token_id"),
            pad_token_id=text.raw.get("pad_token_id"),
            zero_centred_norms=True,
            gdn=gated_deltanet_spec(text, eps) if "gdn" in mixers else None,
            attention=attention,
            mlp=(
                MLPSpec(
                    intermediate_size=text.int("intermediate_size"),
                    activation="silu",
                    gated=True,
                    bias=False,
                )
                if "mlp" in ffns
                else None
            ),
            moe=self._moe(text, model_type) if "moe" in ffns else None,
            mtp_layer_kinds=mtp_kinds,
            num_mtp_steps=num_mtp,
        )

    @staticmethod
    def _mixers(reader: ConfigReader) -> list[LayerKind]:
        if reader.has("layer_types"):
            return parse_layer_names(
                reader, "layer_types", {"gdn", "attention"}, _MIXERS, counted=True
            )
        interval = reader.int("full_attention_interval", 4)
        return [
            "attention" if (i + 1) % interval == 0 else "gdn"
            for i in range(reader.int("num_hidden_layers"))
        ]

    @staticmethod
    def _ffns(reader: ConfigReader, model_type: str, num_layers: int) -> list[LayerKind]:
        if model_type == "qwen3_5_text":
            return ["mlp"] * num_layers
        if model_type == "qwen3_5_moe_text":
            return ["moe"] * num_layers
        if reader.int("num_experts", 0, minimum=0) == 0:
            return ["mlp"] * num_layers
        step = reader.int("decoder_sparse_step", 1)
        mlp_only = reader.raw.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise reader.error("mlp_only_layers", f"expected layer indices, got {mlp_only!r}")
        return [
            "moe" if i not in mlp_only and (i + 1) % step == 0 else "mlp" for i in range(num_layers)
        ]

    @staticmethod
    def _moe(reader: ConfigReader, model_type: str) -> MoESpec:
        shared_size = reader.int("shared_expert_intermediate_size", 0, minimum=0)
        return MoESpec(
            num_experts=reader.int("num_experts"),
            top_k=reader.int("num_experts_per_tok"),
            intermediate_size=reader.int("moe_intermediate_size"),
            activation="silu",
            gated=True,
            router="softmax_topk",
            # Qwen3.5-MoE always renormalises the chosen experts' probabilities.
            norm_topk_prob=model_type != "qwen3_next" or reader.bool("norm_topk_prob", True),
            shared=(
                MLPSpec(intermediate_size=shared_size, activation="silu", gated=True, bias=False)
                if shared_size
                else None
            ),
            shared_gate=bool(shared_size),
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        if name == "lm_head":
            return single("lm_head.weight")
        if name.startswith("mtp."):
            return [
                alt
                for prefix in ("mtp", "model.mtp")
                for alt in self._mtp_sources(config, name.removeprefix("mtp."), prefix)
            ]
        return [alt for prefix in _PREFIXES for alt in self._sources(config, name, prefix)]

    def _mtp_sources(self, config: HybridModelConfig, name: str, prefix: str) -> Alternatives:
        """The fusion and final norms the steps share, and step s's decoder layer
        `layers.{s}` (its attention, then its FFN)."""
        norms = {
            "enorm.weight": "pre_fc_norm_embedding",
            "hnorm.weight": "pre_fc_norm_hidden",
            "final_norm.weight": "norm",
        }
        if name in norms:
            return [[WeightSource(f"{prefix}.{norms[name]}.weight", transform=_plus_one)]]
        if name == "fc.weight":
            return single(f"{prefix}.fc.weight")
        match = MTP_LAYER_NAME.fullmatch(name)
        assert match is not None, name
        step, j, rest = int(match[1]), int(match[2]), match[3]
        return self._sublayer_sources(config, "attention", j == 1, f"{prefix}.layers.{step}", rest)

    def _sources(self, config: HybridModelConfig, name: str, prefix: str) -> Alternatives:
        if name == "embed.weight":
            return single(f"{prefix}.embed_tokens.weight")
        if name == "final_norm.weight":
            return [[WeightSource(f"{prefix}.norm.weight", transform=_plus_one)]]
        match = LAYER_NAME.fullmatch(name)
        assert match is not None, name
        index, is_ffn, rest = int(match[1]) // 2, int(match[1]) % 2 == 1, match[2]
        mixer = config.layer_kinds[2 * index]
        return self._sublayer_sources(config, mixer, is_ffn, f"{prefix}.layers.{index}", rest)

    def _sublayer_sources(
        self, config: HybridModelConfig, mixer: LayerKind, is_ffn: bool, layer: str, rest: str
    ) -> Alternatives:
        """A decoder layer's sublayer: its mixer (`mixer`) or, `is_ffn`, its FFN."""
        if rest == "norm.weight":
            norm = "post_attention_layernorm" if is_ffn else "input_layernorm"
            return [[WeightSource(f"{layer}.{norm}.weight", transform=_plus_one)]]
        param = rest.removeprefix("op.")
        if is_ffn:
            return ffn_sources(config, f"{layer}.mlp", param, _FFN)
        if mixer == "attention":
            if param in ("q_norm.weight", "k_norm.weight"):
                return [[WeightSource(f"{layer}.self_attn.{param}", transform=_plus_one)]]
            return single(f"{layer}.self_attn.{param}")
        return self._gdn_sources(config, f"{layer}.linear_attn", param)

    @staticmethod
    def _gdn_sources(config: HybridModelConfig, mixer: str, param: str) -> Alternatives:
        spec = config.gdn
        assert spec is not None
        renames = {"conv_weight": "conv1d.weight", "norm_weight": "norm.weight"}
        kd, vd, hv = spec.key_dim, spec.value_dim, spec.num_value_heads
        if param in ("in_proj.weight", "in_proj_ba.weight"):
            qkvz_rows, ba_rows = _fused_rows(spec)
        if param == "in_proj.weight":
            return [
                [  # Qwen3.5: one tensor per section
                    WeightSource(f"{mixer}.in_proj_qkv.weight", slice(0, 2 * kd + vd)),
                    WeightSource(f"{mixer}.in_proj_z.weight", slice(2 * kd + vd, None)),
                ],
                # Qwen3-Next: fused per key head, scattered into our rows
                [WeightSource(f"{mixer}.in_proj_qkvz.weight", qkvz_rows)],
            ]
        if param == "in_proj_ba.weight":
            return [
                [
                    WeightSource(f"{mixer}.in_proj_b.weight", slice(0, hv)),
                    WeightSource(f"{mixer}.in_proj_a.weight", slice(hv, None)),
                ],
                [WeightSource(f"{mixer}.in_proj_ba.weight", ba_rows)],
            ]
        return single(f"{mixer}.{renames.get(param, param)}")


def _fused_rows(spec: GatedDeltaNetSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row of Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` goes in our in_proj rows
    q | k | v | z and in_proj_ba rows b | a: key head h's rows are [q_h | k_h | v_h | z_h] and
    [b_h | a_h], its value heads being h * r ... h * r + r - 1 (r = Hv / Hk)."""
    dk, dv, hk, hv = (
        spec.key_head_dim,
        spec.value_head_dim,
        spec.num_key_heads,
        spec.num_value_heads,
    )
    r = hv // hk
    kd, vd = spec.key_dim, spec.value_dim
    qkvz, ba = [], []
    for h in range(hk):
        qkvz += range(h * dk, (h + 1) * dk)  # q
        qkvz += range(kd + h * dk, kd + (h + 1) * dk)  # k
        qkvz += range(2 * kd + h * r * dv, 2 * kd + (h + 1) * r * dv)  # v
        qkvz += range(2 * kd + vd + h * r * dv, 2 * kd + vd + (h + 1) * r * dv)  # z
        ba += range(h * r, (h + 1) * r)  # b
        ba += range(hv + h * r, hv + (h + 1) * r)  # a
    return torch.tensor(qkvz), torch.tensor(ba)
