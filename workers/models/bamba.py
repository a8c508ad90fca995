"""Bamba: each layer is a Mamba2 or attention mixer followed by a gated MLP.

Attention layers are listed by `attn_layer_indices` (or a `layer_types` list); attention uses
RoPE on half of each head. Each HF layer becomes two sublayers here: mixer, then MLP.
"""

from __future__ import annotations

from hybridserve.workers.models.adapter import (
    Alternatives,
    ModelFamily,
    attention_spec,
    check_mamba,
    gate_and_up,
    mamba_key,
    model_sources,
    single,
    split_layer_name,
)
from hybridserve.workers.models.config import (
    ConfigReader,
    HybridModelConfig,
    LayerKind,
    MambaGate,
    MambaSpec,
    MLPSpec,
    parse_layer_names,
)

MIXER_KINDS: set[LayerKind] = {"mamba2", "attention"}


def mixer_kinds(reader: ConfigReader, index_field: str | None) -> list[LayerKind]:
    """Per-layer mixer kinds from a `layer_types`-style list or a list of attention indices."""
    for field in ("layer_types", "layers_block_type"):
        if reader.has(field):
            return parse_layer_names(reader, field, MIXER_KINDS, counted=True)
    num_layers = reader.int("num_hidden_layers")
    indices = reader.raw.get(index_field) if index_field else None
    indices = indices or []
    if not isinstance(indices, list) or not all(
        isinstance(i, int) and 0 <= i < num_layers for i in indices
    ):
        raise reader.error(
            str(index_field), f"expected layer indices in [0, {num_layers}), got {indices!r}"
        )
    return ["attention" if i in indices else "mamba2" for i in range(num_layers)]


def mamba_spec(
    reader: ConfigReader, hidden: int, eps: float, gate: MambaGate = "norm_after_gate"
) -> MambaSpec:
    """The `mamba_*` config fields of Bamba, GraniteMoeHybrid and Falcon-H1 (whose inner size
    may be given as `mamba_d_ssm`)."""
    heads = reader.int("mamba_n_heads")
    inner = (
        reader.int("mamba_d_ssm")
        if reader.has("mamba_d_ssm")
        else reader.int("mamba_expand", 2) * hidden
    )
    head_dim = (
        inner // heads
        if reader.raw.get("mamba_d_head", "auto") == "auto"
        else reader.int("mamba_d_head")
    )
    if heads * head_dim != inner:
        raise reader.error(
            "mamba_d_head",
            f"mamba_n_heads ({heads}) * mamba_d_head ({head_dim}) must equal the Mamba inner "
            f"size ({inner}: mamba_d_ssm, or mamba_expand * hidden_size)",
        )
    dt_min, dt_max = reader.dt_limit("time_step_limit")
    spec = MambaSpec(
        num_heads=heads,
        head_dim=head_dim,
        state_size=reader.int("mamba_d_state"),
        n_groups=reader.int("mamba_n_groups", 1),
        conv_kernel=reader.int("mamba_d_conv", 4, minimum=2),
        chunk_size=reader.int("mamba_chunk_size", 256),
        conv_bias=reader.bool("mamba_conv_bias", True),
        proj_bias=reader.bool("mamba_proj_bias", False),
        activation=reader.activation("hidden_act", "silu"),
        norm_eps=eps,
        dt_min=dt_min,
        dt_max=dt_max,
        gate=gate,
    )
    check_mamba(
        reader,
        spec,
        heads_field="mamba_n_heads",
        groups_field="mamba_n_groups",
        activation_field="hidden_act",
    )
    return spec


def interleave(mixers: list[LayerKind], ffn: LayerKind) -> tuple[LayerKind, ...]:
    return tuple(kind for mixer in mixers for kind in (mixer, ffn))


class BambaAdapter:
    model_types = ("bamba",)
    families = (ModelFamily("Bamba", model_types, (("dense", "bamba", {}),)),)
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        mixers = mixer_kinds(reader, "attn_layer_indices")
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-5, positive=True)
        return HybridModelConfig(
            architecture="bamba",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=interleave(mixers, "mlp"),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 262144),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            mamba2=mamba_spec(reader, hidden, eps) if "mamba2" in mixers else None,
            attention=(
                attention_spec(
                    reader, hidden, bias=reader.bool("attention_bias", False), rope_partial=0.5
                )
                if "attention" in mixers
                else None
            ),
            mlp=MLPSpec(
                intermediate_size=reader.int("intermediate_size"),
                activation=reader.activation("hidden_act", "silu"),
                gated=True,
                bias=reader.bool("mlp_bias", False),
            ),
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
            if param.startswith("gate_up_proj."):
                assert config.mlp is not None
                size, suffix = config.mlp.intermediate_size, param.removeprefix("gate_up_proj.")
                ffn = f"{layer}.feed_forward"
                return [gate_and_up(f"{ffn}.gate_proj.{suffix}", f"{ffn}.up_proj.{suffix}", size)]
            return single(f"{layer}.feed_forward.{param}")
        if config.layer_kinds[2 * index] == "mamba2":
            return single(mamba_key(f"{layer}.mamba", param))
        return single(f"{layer}.self_attn.{param}")
