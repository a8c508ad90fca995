"""HF config.json normalisation: ConfigReader + the architecture adapters -> HybridModelConfig."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from hybridserve.workers.models.tiny import TINY_CONFIG
from tests.workers.models.configs import FILE, config_error, parse

NEMOTRON_MOE = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 96,
}


def nemotron(**changes: Any) -> dict[str, Any]:
    raw = dict(TINY_CONFIG) | NEMOTRON_MOE | changes
    return {k: v for k, v in raw.items() if v is not _DROP}


_DROP: Any = object()


def bamba(**changes: Any) -> dict[str, Any]:
    from transformers import BambaConfig

    raw = BambaConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
    ).to_dict()
    return {k: v for k, v in (raw | changes).items() if v is not _DROP}


def granite(**changes: Any) -> dict[str, Any]:
    from transformers import GraniteMoeHybridConfig

    raw = GraniteMoeHybridConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=2,
        mamba_d_state=16,
        position_embedding_type=None,
        attention_multiplier=0.25,
    ).to_dict()
    return {k: v for k, v in (raw | changes).items() if v is not _DROP}


# ---- NemotronH ----------------------------------------------------------------------------


def test_tiny_config_parses_to_the_expected_model():
    config = parse(dict(TINY_CONFIG))
    assert config.architecture == "nemotron_h"
    assert config.layer_kinds == (
        "mamba2", "attention", "mlp", "mamba2", "attention", "mlp", "mamba2", "mlp"
    )  # fmt: skip
    assert (config.num_recurrent_layers, config.num_attention_layers) == (3, 2)
    assert config.mamba2.conv_dim == 8 * 32 + 2 * 2 * 32
    assert (config.attention.num_heads, config.attention.num_kv_heads) == (4, 2)
    assert config.attention.rope is None  # NemotronH attention has no positional encoding
    assert config.attention.scale == 32**-0.5
    assert config.mlp.activation == "relu2" and not config.mlp.gated
    assert config.eos_token_ids == (256, 258)
    assert config.moe is None  # MoE fields are present in no layer


def test_hybrid_override_pattern_maps_every_symbol():
    config = parse(nemotron(hybrid_override_pattern="M*-E"))
    assert config.layer_kinds == ("mamba2", "attention", "mlp", "moe")
    assert config.moe.num_experts == 4 and config.moe.router == "sigmoid_grouped"
    assert config.moe.shared.intermediate_size == 96


@pytest.mark.parametrize(
    ("names", "kinds"),
    [
        (["mamba", "attention", "mlp", "moe"], ("mamba2", "attention", "mlp", "moe")),
        (
            ["linear_attention", "full_attention", "mlp", "moe"],
            ("mamba2", "attention", "mlp", "moe"),
        ),
        (["mamba2", "full_attention", "mamba"], ("mamba2", "attention", "mamba2")),
    ],
)
@pytest.mark.parametrize("field", ["layers_block_type", "layer_types"])
def test_layer_type_lists_accept_current_and_legacy_names(field, names, kinds):
    raw = nemotron(hybrid_override_pattern=_DROP) | {field: names}
    assert parse(raw).layer_kinds == kinds


def test_a_layer_list_wins_over_the_pattern():
    raw = nemotron(hybrid_override_pattern="MMMM", layers_block_type=["mamba", "attention"])
    assert parse(raw).layer_kinds == ("mamba2", "attention")


def test_transformers_nemotron_h_config_round_trips():
    from transformers import NemotronHConfig

    hf = NemotronHConfig(
        vocab_size=128,
        hidden_size=64,
        hybrid_override_pattern="M*-E",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=16,
        n_routed_experts=4,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
    )
    raw = json.loads(hf.to_json_string())  # as it lands in config.json
    config = parse(raw)
    assert config.layer_kinds == ("mamba2", "attention", "mlp", "moe")
    assert (config.mamba2.dt_min, config.mamba2.dt_max) == (0.0, math.inf)
    assert config.mamba2.n_groups == 2 and config.mamba2.head_dim == 8


def test_unknown_pattern_symbol_names_file_field_and_symbol():
    error = config_error(nemotron(hybrid_override_pattern="M*X-"))
    assert (error.file, error.field) == (FILE, "hybrid_override_pattern")
    message = str(error)
    assert message.startswith("ckpt/config.json: field 'hybrid_override_pattern': ")
    assert "unknown layer symbol 'X' at position 2" in message
    assert "M = mamba" in message  # lists what is known


def test_unknown_layer_name_names_field_index_and_name():
    raw = nemotron(hybrid_override_pattern=_DROP, layers_block_type=["mamba", "conv"])
    message = str(config_error(raw))
    assert message.startswith("ckpt/config.json: field 'layers_block_type': ")
    assert "unknown layer type 'conv' at index 1" in message


def test_missing_layer_layout_is_named():
    message = str(config_error(nemotron(hybrid_override_pattern=_DROP)))
    assert "field 'layers_block_type': required but missing" in message


def test_missing_required_field_is_named():
    error = config_error(nemotron(hidden_size=_DROP))
    assert str(error) == "ckpt/config.json: field 'hidden_size': required but missing"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_size", "128", "expected an integer, got '128'"),
        ("hidden_size", 128.0, "expected an integer, got 128.0"),
        ("hidden_size", True, "expected an integer, got True"),
        ("mamba_num_heads", 0, "must be >= 1, got 0"),
        ("use_conv_bias", "yes", "expected true or false, got 'yes'"),
        ("layer_norm_epsilon", "small", "expected a number, got 'small'"),
        ("layer_norm_epsilon", 0.0, "must be > 0, got 0.0"),
        ("mlp_hidden_act", "tanh", "unsupported activation 'tanh'"),
        ("eos_token_id", [1, "2"], "expected a token id or a list of token ids"),
        ("n_groups", 3, "3 groups do not divide mamba_num_heads=8"),
        ("num_key_value_heads", 3, "3 does not divide num_attention_heads=4"),
    ],
)
def test_wrong_values_name_the_field(field, value, message):
    error = config_error(nemotron(**{field: value}))
    assert error.field == field
    assert str(error).startswith(f"ckpt/config.json: field '{field}': ")
    assert message in str(error)


def test_legacy_mamba_aliases():
    raw = nemotron(
        n_groups=_DROP,
        conv_kernel=_DROP,
        chunk_size=_DROP,
        mamba_n_groups=4,
        mamba_d_conv=3,
        mamba_chunk_size=32,
    )
    spec = parse(raw).mamba2
    assert (spec.n_groups, spec.conv_kernel, spec.chunk_size) == (4, 3, 32)


def test_current_names_win_over_legacy_aliases():
    spec = parse(nemotron(n_groups=2, mamba_n_groups=4)).mamba2
    assert spec.n_groups == 2


def test_an_alias_with_a_wrong_value_is_named_by_its_own_name():
    error = config_error(nemotron(conv_kernel=_DROP, mamba_d_conv=1))
    assert error.field == "mamba_d_conv"
    assert "must be >= 2, got 1" in str(error)


@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),
        ([0.0, "Infinity"], (0.0, math.inf)),
        ([0.0, math.inf], (0.0, math.inf)),
        ([0.001, 0.1], (0.001, 0.1)),
        (None, (0.0, math.inf)),
    ],
)
def test_time_step_limit(value, limit):
    spec = parse(nemotron(time_step_limit=value)).mamba2
    assert (spec.dt_min, spec.dt_max) == limit


@pytest.mark.parametrize("value", [[0.1, 0.01], [0.0], "inf", [-1.0, 1.0], [0.0, "big"]])
def test_bad_time_step_limit_is_named(value):
    error = config_error(nemotron(time_step_limit=value))
    assert error.field == "time_step_limit"


def test_time_step_limit_alias_from_json_text():
    text = json.dumps(nemotron(time_step_limit=_DROP, mamba_dt_limit=[0.0, math.inf]))
    assert '"mamba_dt_limit": [0.0, Infinity]' in text  # what json writes for inf
    raw = json.loads(text)
    spec = parse(raw).mamba2
    assert (spec.dt_min, spec.dt_max) == (0.0, math.inf)


def test_moe_geometry_errors_are_named():
    error = config_error(nemotron(hybrid_override_pattern="ME", num_experts_per_tok=5))
    assert error.field == "num_experts_per_tok"
    assert "5 is more than the 4 routed experts" in str(error)
    error = config_error(nemotron(hybrid_override_pattern="ME", n_group=3))
    assert error.field == "n_group"


# ---- Bamba --------------------------------------------------------------------------------


def test_bamba_attention_indices_interleave_mixers_and_mlps():
    config = parse(bamba())
    assert config.architecture == "bamba"
    assert config.layer_kinds == (
        "mamba2", "mlp", "attention", "mlp", "mamba2", "mlp", "attention", "mlp"
    )  # fmt: skip
    assert config.mlp.gated and config.mlp.intermediate_size == 96
    assert config.attention.rope.rotary_dim == 8  # half of head_dim 16
    assert config.attention.rope.theta == 10000.0
    assert (config.mamba2.num_heads, config.mamba2.head_dim, config.mamba2.n_groups) == (8, 16, 2)


def test_bamba_without_attention_layers():
    config = parse(bamba(attn_layer_indices=None))
    assert config.layer_kinds == ("mamba2", "mlp") * 4
    assert config.attention is None


@pytest.mark.parametrize("indices", [[1, 4], [-1], "1,3"])
def test_bamba_bad_attention_index_is_named(indices):
    error = config_error(bamba(attn_layer_indices=indices))
    assert error.field == "attn_layer_indices"
    assert "expected layer indices in [0, 4)" in str(error)


def test_bamba_layer_types_must_match_num_hidden_layers():
    error = config_error(bamba(layer_types=["mamba", "attention"]))
    assert error.field == "layer_types"
    assert "lists 2 layers but num_hidden_layers is 4" in str(error)


def test_bamba_rejects_moe_layer_names():
    error = config_error(bamba(layer_types=["mamba", "moe", "mamba", "mamba"]))
    assert "unknown layer type 'moe' at index 1" in str(error)


def test_bamba_mamba_head_geometry_is_checked():
    error = config_error(bamba(mamba_d_head=8))
    assert error.field == "mamba_d_head"
    assert "mamba_n_heads (8) * mamba_d_head (8) must equal the Mamba inner size (128" in (
        str(error)
    )


# ---- GraniteMoeHybrid ---------------------------------------------------------------------


@pytest.mark.parametrize("names", [["mamba", "attention"], ["linear_attention", "full_attention"]])
def test_granite_layer_types_current_and_legacy(names):
    config = parse(granite(layer_types=names))
    assert config.architecture == "granitemoehybrid"
    assert config.layer_kinds == ("mamba2", "moe", "attention", "moe")
    assert config.moe.router == "softmax_topk" and config.moe.gated
    assert config.moe.shared.intermediate_size == 48
    assert config.mlp is None
    assert config.attention.scale == 0.25  # attention_multiplier


def test_granite_without_layer_types_is_all_mamba():
    config = parse(granite(layer_types=_DROP, num_hidden_layers=3))
    assert config.layer_kinds == ("mamba2", "moe") * 3
    assert config.attention is None


def test_granite_without_experts_is_a_dense_shared_mlp():
    config = parse(granite(num_local_experts=0))
    assert config.layer_kinds == ("mamba2", "mlp", "attention", "mlp")
    assert config.moe is None
    assert config.mlp.intermediate_size == 48 and config.mlp.gated


@pytest.mark.parametrize(
    ("position_embedding_type", "rotary_dim"), [("rope", 16), (None, None), ("nope", None)]
)
def test_granite_rope_only_with_position_embedding_type_rope(position_embedding_type, rotary_dim):
    config = parse(granite(position_embedding_type=position_embedding_type))
    rope = config.attention.rope
    assert (None if rope is None else rope.rotary_dim) == rotary_dim


def test_granite_unknown_position_embedding_is_named():
    error = config_error(granite(position_embedding_type="alibi"))
    assert error.field == "position_embedding_type"
    assert "expected null or 'rope', got 'alibi'" in str(error)


def test_granite_scales_are_read():
    config = parse(granite(embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8))
    assert (config.embedding_multiplier, config.residual_multiplier, config.logits_divisor) == (
        12.0,
        0.22,
        8.0,
    )


# ---- registry -----------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", None, 3])
def test_unsupported_model_type_lists_the_supported_ones(model_type):
    raw = dict(TINY_CONFIG) | {"model_type": model_type}
    error = config_error(raw)
    assert error.field == "model_type"
    assert str(error) == (
        f"ckpt/config.json: field 'model_type': unsupported model type {model_type!r} "
        "(supported: bamba, falcon_h1, granitemoehybrid, jamba, kimi_linear, lfm2, lfm2_moe, "
        "nemotron_h, olmo_hybrid, qwen3_5, qwen3_5_moe, qwen3_5_moe_text, qwen3_5_text, "
        "qwen3_next, zamba2)"
    )


# ---- Falcon-H1 -----------------------------------------------------------------------------


def falcon(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "falcon_h1",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "mamba_n_heads": 8,
        "mamba_d_ssm": 64,
        "mamba_d_head": "auto",
        "mamba_n_groups": 2,
        "mamba_d_state": 16,
    } | changes


def test_a_falcon_h1_config_parses_to_parallel_mixers_and_folded_multipliers():
    config = parse(falcon(lm_head_multiplier=0.5, ssm_multipliers=[1, 2, 3, 4, 5]))
    assert config.layer_kinds == ("mamba2", "attention", "mlp") * 2
    assert config.parallel_layer_ids == (1, 4)  # each attention reads its Mamba2's input
    assert config.logits_divisor == 2.0
    assert config.mamba2 is not None and config.mamba2.head_dim == 8
    assert config.mamba2.gate == "no_norm"
    assert config.weight_multipliers["ssm_dt"] == 5.0


@pytest.mark.parametrize(
    ("changes", "gate"),
    [
        ({"mamba_rms_norm": True}, "norm_before_gate"),
        ({"mamba_rms_norm": True, "mamba_norm_before_gate": False}, "norm_after_gate"),
    ],
)
def test_falcon_h1_mamba_gate_follows_the_config(changes, gate):
    config = parse(falcon(**changes))
    assert config.mamba2 is not None and config.mamba2.gate == gate


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"mamba_d_head": 10}, "mamba_d_head",
         "mamba_n_heads (8) * mamba_d_head (10) must equal the Mamba inner size (64"),
        ({"mamba_proj_bias": True}, "projectors_bias", "must equal mamba_proj_bias"),
        ({"ssm_multipliers": [1, 2]}, "ssm_multipliers", "expected 5 numbers, got [1, 2]"),
        ({"mlp_multipliers": [1, "x"]}, "mlp_multipliers", "expected a number, got 'x'"),
        ({"lm_head_multiplier": 0}, "lm_head_multiplier", "must be > 0"),
        ({"hidden_act": "gelu"}, "hidden_act", "must be silu (the MLP and the Mamba conv)"),
    ],
)  # fmt: skip
def test_a_bad_falcon_h1_config_is_refused_naming_the_field(changes, field, message):
    error = config_error(falcon(**changes))
    assert error.field == field and message in str(error)
