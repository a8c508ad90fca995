"""config.json of Zamba2 (a Mamba2 backbone with shared transformer blocks) ->
HybridModelConfig."""

from __future__ import annotations

from typing import Any

import pytest

from tests.workers.models.configs import config_error, parse


def zamba2(**changes: Any) -> dict[str, Any]:
    return {
        "model_type": "zamba2",
        "vocab_size": 128,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "linear_attention", "hybrid"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_mamba_heads": 8,
        "num_mem_blocks": 2,
        "use_shared_attention_adapter": True,
        "adapter_rank": 8,
    } | changes


def test_a_zamba2_config_parses_to_mamba2_layers_fed_by_shared_block_invocations():
    config = parse(zamba2())
    assert config.layer_kinds == (
        *("mamba2", "shared_block", "mamba2"),
        *("mamba2", "shared_block", "mamba2"),
    )
    assert config.attention_layer_ids == (1, 4)  # each invocation keeps its own KV layer
    attention, block, mamba = config.attention, config.shared_block, config.mamba2
    assert attention is not None and block is not None and mamba is not None
    # [hidden | embeddings] in, head_dim 2 * 64 / 4, scaled by (head_dim / 2)^-1/2, no RoPE
    assert (attention.input_size, attention.head_dim, attention.rope) == (128, 32, None)
    assert attention.scale == pytest.approx(16**-0.5)
    assert (block.num_blocks, block.adapter_rank, block.attention_adapters) == (2, 8, True)
    assert (block.mlp.intermediate_size, block.mlp.activation) == (256, "gelu")  # 4 x hidden
    assert (mamba.head_dim, mamba.state_size, mamba.norm_eps, mamba.dt_min) == (16, 64, 1e-5, 1e-3)
    assert config.tie_word_embeddings


def test_untied_embeddings_give_every_invocation_a_block_of_its_own():
    """As transformers does: it ties the shared blocks only together with the embeddings."""
    block = parse(zamba2(tie_word_embeddings=False, num_mem_blocks=1)).shared_block
    assert block is not None and block.num_blocks == 2  # two invocations, two blocks
    block = parse(zamba2(num_mem_blocks=1)).shared_block
    assert block is not None and block.num_blocks == 1


def test_rope_in_the_shared_attention_turns_the_whole_head():
    attention = parse(zamba2(use_mem_rope=True)).attention
    assert attention is not None and attention.rope is not None
    assert attention.rope.rotary_dim == 32


@pytest.mark.parametrize(
    ("raw", "field", "message"),
    [
        (zamba2(num_key_value_heads=2), "num_key_value_heads",
         "needs num_attention_heads (4) key-value heads"),
        (zamba2(layers_block_type=["mamba", "attention", "mamba", "hybrid"]),
         "layers_block_type", "unknown layer type 'attention' at index 1"),
        (zamba2(num_hidden_layers=5), "layers_block_type",
         "lists 4 layers but num_hidden_layers is 5"),
        (zamba2(num_attention_heads=3), "num_attention_heads",
         "3 does not divide twice the hidden size 64"),
    ],
)  # fmt: skip
def test_a_bad_zamba2_config_is_refused_naming_the_field(raw, field, message):
    error = config_error(raw)
    assert error.field == field and message in str(error)
