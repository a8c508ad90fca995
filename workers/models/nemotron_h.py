"""NemotronH (Nemotron-H, Nemotron 3 Nano): one op per layer, chosen by a pattern.

Layer types come from `layers_block_type` / `layer_types` (a list) or the legacy
`hybrid_override_pattern` string (M = Mamba2, * = attention, - = MLP, E = MoE). Attention has no
positional encoding; MLPs are ungated relu2; MoE layers use sigmoid routing with a score
correction bias, group-limited top-k and a shared expert. Weights live under `backbone.*`
(original checkpoints) or `model.*`.
"""

from __future__ import annotations

import logging
import re

from hybridserve.workers.models.adapter import (
    LAYER_NAME,
    MTP_LAYER_NAME,
    Alternatives,
    ModelFamily,
    WeightSource,
    attention_spec,
    check_mamba,
    mamba_key,
    single,
    stacked_experts,
)
from hybridserve.workers.models.config import (
    ConfigReader,
    HybridModelConfig,
    LayerKind,
    MambaSpec,
    MLPSpec,
    MoESpec,
    parse_layer_names,
)

logger = logging.getLogger(__name__)

PATTERN_SYMBOLS: dict[str, LayerKind] = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
ALL_KINDS: set[LayerKind] = {"mamba2", "attention", "mlp", "moe"}


def layer_kinds(reader: ConfigReader) -> list[LayerKind]:
    for field in ("layers_block_type", "layer_types"):
        if reader.has(field):
            kinds = parse_layer_names(reader, field, ALL_KINDS)
            break
    else:
        field = "hybrid_override_pattern"
        pattern = reader.raw.get(field)
        if not isinstance(pattern, str) or not pattern:
            raise reader.error(
                "layers_block_type",
                "required but missing (give layers_block_type, layer_types or "
                "hybrid_override_pattern)",
            )
        kinds = []
        for position, symbol in enumerate(pattern):
            if symbol not in PATTERN_SYMBOLS:
                known = ", ".join(f"{s} = {k}" for s, k in PATTERN_SYMBOLS.items())
                raise reader.error(
                    field,
                    f"unknown layer symbol {symbol!r} at position {position} (known: {known})",
                )
            kinds.append(PATTERN_SYMBOLS[symbol])
    declared = reader.raw.get("num_hidden_layers")
    if declared is not None and declared != len(kinds):
        logger.warning(
            "%s: num_hidden_layers=%s but %s lists %d layers; using the list",
            reader.file,
            declared,
            field,
            len(kinds),
        )
    return kinds


def mtp_layer_kinds(reader: ConfigReader) -> list[LayerKind]:
    """The multi-token-prediction layers of one step (`mtp_hybrid_override_pattern`, or
    `mtp_layers_block_type`); [] without them."""
    field = "mtp_layers_block_type"
    if reader.has(field):
        kinds = parse_layer_names(reader, field, ALL_KINDS)
    else:
        field = "mtp_hybrid_override_pattern"
        pattern = reader.raw.get(field) or ""
        if not isinstance(pattern, str):
            raise reader.error(field, f"expected a string, got {pattern!r}")
        unknown = next((symbol for symbol in pattern if symbol not in PATTERN_SYMBOLS), None)
        if unknown is not None:
            raise reader.error(field, f"unknown layer symbol {unknown!r}")
        kinds = [PATTERN_SYMBOLS[symbol] for symbol in pattern]
    if "mamba2" in kinds:
        raise reader.error(field, "Mamba2 multi-token-prediction layers are not supported")
    return kinds


class NemotronHAdapter:
    model_types = ("nemotron_h",)
    families = (
        ModelFamily(
            "NemotronH (Nemotron-H, Nemotron 3 Nano)",
            model_types,
            (
                ("dense", "nemotron_h", {"layers_block_type": ["mamba", "attention", "mlp"]}),
                ("MoE", "nemotron_h", {"num_nextn_predict_layers": 1}),
            ),
        ),
    )
    # Multi-token-prediction layers: loaded only when speculative decoding uses them.
    ignored_keys = re.compile(r"^(mtp|backbone\.mtp|model\.mtp)\.")

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        main_kinds = layer_kinds(reader)
        # transformers writes an MTP pattern into every config; the layers exist only where
        # num_nextn_predict_layers says so.
        num_mtp = reader.int("num_nextn_predict_layers", 0, minimum=0)
        mtp_kinds = mtp_layer_kinds(reader) if num_mtp else []
        kinds = [*main_kinds, *mtp_kinds]  # the kinds whose specs are needed
        hidden = reader.int("hidden_size")
        eps = reader.float("layer_norm_epsilon", 1e-5, aliases=("rms_norm_eps",), positive=True)
        mamba = attention = mlp = moe = None
        if "mamba2" in kinds:
            dt_min, dt_max = reader.dt_limit("time_step_limit", aliases=("mamba_dt_limit",))
            mamba = MambaSpec(
                num_heads=reader.int("mamba_num_heads"),
                head_dim=reader.int("mamba_head_dim"),
                state_size=reader.int("ssm_state_size"),
                n_groups=reader.int("n_groups", aliases=("mamba_n_groups",)),
                conv_kernel=reader.int("conv_kernel", 4, aliases=("mamba_d_conv",), minimum=2),
                chunk_size=reader.int("chunk_size", 128, aliases=("mamba_chunk_size",)),
                conv_bias=reader.bool("use_conv_bias", True, aliases=("mamba_conv_bias",)),
                proj_bias=reader.bool("use_bias", False),
                activation=reader.activation("mamba_hidden_act", "silu"),
                norm_eps=eps,
                # `time_step_limit` as training (Megatron) and vLLM apply it, in every path.
                # NOTE: transformers clamps at time_step_min in its multi-token path only; the
                # two agree whenever dt stays above time_step_min.
                dt_min=dt_min,
                dt_max=dt_max,
            )
            check_mamba(
                reader,
                mamba,
                heads_field="mamba_num_heads",
                groups_field="n_groups",
                activation_field="mamba_hidden_act",
            )
        if "attention" in kinds:
            attention = attention_spec(reader, hidden, bias=False, rope_partial=None)
        if "mlp" in kinds:
            mlp = MLPSpec(
                intermediate_size=reader.int("intermediate_size"),
                activation=reader.activation("mlp_hidden_act", "relu2"),
                gated=False,
                bias=reader.bool("mlp_bias", False),
            )
        if "moe" in kinds:
            moe = self._moe_spec(reader)
        return HybridModelConfig(
            architecture="nemotron_h",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(main_kinds),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 4096),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            mamba2=mamba,
            attention=attention,
            mlp=mlp,
            moe=moe,
            mtp_layer_kinds=tuple(mtp_kinds),
            num_mtp_steps=num_mtp if mtp_kinds else 0,
        )

    def _moe_spec(self, reader: ConfigReader) -> MoESpec:
        num_experts = reader.int("n_routed_experts", aliases=("num_local_experts",))
        top_k = reader.int("num_experts_per_tok")
        groups = reader.int("n_group", 1)
        topk_groups = reader.int("topk_group", 1)
        if top_k > num_experts:
            raise reader.error(
                "num_experts_per_tok", f"{top_k} is more than the {num_experts} routed experts"
            )
        if num_experts % groups or num_experts // groups < 2:
            raise reader.error(
                "n_group", f"{num_experts} experts cannot form {groups} groups of at least 2"
            )
        if topk_groups > groups:
            raise reader.error("topk_group", f"{topk_groups} is more than n_group={groups}")
        activation = reader.activation("mlp_hidden_act", "relu2")
        shared = None
        if reader.int("n_shared_experts", 1, minimum=0) > 0:
            shared = MLPSpec(
                intermediate_size=reader.int("moe_shared_expert_intermediate_size"),
                activation=activation,
                gated=False,
                bias=reader.bool("mlp_bias", False),
            )
        latent = reader.raw.get("moe_latent_size")
        return MoESpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=reader.int("moe_intermediate_size"),
            activation=activation,
            gated=False,
            router="sigmoid_grouped",
            num_expert_groups=groups,
            topk_groups=topk_groups,
            norm_topk_prob=reader.bool("norm_topk_prob", True),
            routed_scaling_factor=reader.float("routed_scaling_factor", 1.0),
            latent_size=None if latent is None else reader.int("moe_latent_size"),
            shared=shared,
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        if name == "lm_head":
            return single("lm_head.weight")
        if name.startswith("mtp."):
            return [
                alt
                for prefix in ("mtp", "backbone.mtp", "model.mtp")
                for alt in self._mtp_sources(config, name.removeprefix("mtp."), prefix)
            ]
        return [
            alt for prefix in ("backbone", "model") for alt in self._sources(config, name, prefix)
        ]

    def _sources(self, config: HybridModelConfig, name: str, prefix: str) -> Alternatives:
        if name == "embed.weight":
            return single(f"{prefix}.embeddings.weight")
        if name == "final_norm.weight":
            return single(f"{prefix}.norm_f.weight")
        match = LAYER_NAME.fullmatch(name)
        assert match is not None, name
        index, rest = int(match[1]), match[2]
        return self._layer_sources(
            config, config.layer_kinds[index], f"{prefix}.layers.{index}", rest
        )

    def _mtp_sources(self, config: HybridModelConfig, name: str, prefix: str) -> Alternatives:
        """The MTP blocks: the first fuses (enorm, hnorm, eh_proj), the last ends with
        final_layernorm; step s's block j is `layers.{s * len(pattern) + j}`."""
        per_step = len(config.mtp_layer_kinds)
        fixed = {
            "enorm.weight": f"{prefix}.layers.0.enorm.weight",
            "hnorm.weight": f"{prefix}.layers.0.hnorm.weight",
            "fc.weight": f"{prefix}.layers.0.eh_proj.weight",
            "final_norm.weight": f"{prefix}.layers.{per_step - 1}.final_layernorm.weight",
        }
        if name in fixed:
            return single(fixed[name])
        match = MTP_LAYER_NAME.fullmatch(name)
        assert match is not None, name
        step, j, rest = int(match[1]), int(match[2]), match[3]
        layer = f"{prefix}.layers.{step * per_step + j}"
        return self._layer_sources(config, config.mtp_layer_kinds[j], layer, rest)

    def _layer_sources(
        self, config: HybridModelConfig, kind: LayerKind, layer: str, rest: str
    ) -> Alternatives:
        if rest == "norm.weight":
            return single(f"{layer}.norm.weight")
        param = rest.removeprefix("op.")
        mixer = f"{layer}.mixer"
        if kind == "mamba2":
            return single(mamba_key(mixer, param))
        if kind != "moe":
            return single(f"{mixer}.{param}")
        assert config.moe is not None
        experts = config.moe.num_experts
        renames = {
            "router.weight": "gate.weight",
            "router.score_bias": "gate.e_score_correction_bias",
            "latent_in.weight": "fc1_latent_proj.weight",
            "latent_out.weight": "fc2_latent_proj.weight",
        }
        if param == "experts.up":
            return stacked_experts(f"{mixer}.experts", "up_proj", "up_proj.weight", experts)
        if param == "experts.down":
            return stacked_experts(f"{mixer}.experts", "down_proj", "down_proj.weight", experts)
        if param.startswith("shared."):
            return [[WeightSource(f"{mixer}.shared_experts.{param.removeprefix('shared.')}")]]
        return single(f"{mixer}.{renames[param]}")
