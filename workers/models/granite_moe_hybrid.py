"""GraniteMoeHybrid (Granite 4.0-H): Mamba2 / attention mixers, each followed by MoE + shared MLP.

Granite scales the embeddings, every residual branch and the logits, and uses
`attention_multiplier` as the attention scale. Attention has RoPE only when
`position_embedding_type == "rope"`. With `num_local_experts == 0` the FFN is the shared MLP alone.
"""

from __future__ import annotations

from hybridserve.workers.models.adapter import (
    Alternatives,
    ModelFamily,
    attention_spec,
    mamba_key,
    model_sources,
    single,
    split_layer_name,
)
from hybridserve.workers.models.bamba import (
    interleave,
    mamba_spec,
    mixer_kinds,
)
from hybridserve.workers.models.config import ConfigReader, HybridModelConfig, MLPSpec, MoESpec


class GraniteMoeHybridAdapter:
    model_types = ("granitemoehybrid",)
    families = (
        ModelFamily(
            "GraniteMoeHybrid (Granite 4.0-H)",
            model_types,
            (
                ("dense", "granitemoehybrid", {"num_local_experts": 0}),
                ("MoE", "granitemoehybrid", {}),
            ),
        ),
    )
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        mixers = (
            mixer_kinds(reader, None)
            if reader.has("layer_types", "layers_block_type")
            else ["mamba2"] * reader.int("num_hidden_layers")
        )
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-6, positive=True)
        activation = reader.activation("hidden_act", "silu")
        shared = MLPSpec(
            intermediate_size=reader.int("shared_intermediate_size"),
            activation=activation,
            gated=True,
            bias=False,
        )
        num_experts = reader.int("num_local_experts", 8, minimum=0)
        moe = None
        if num_experts:
            top_k = reader.int("num_experts_per_tok", 2)
            if top_k > num_experts:
                raise reader.error(
                    "num_experts_per_tok", f"{top_k} is more than num_local_experts={num_experts}"
                )
            moe = MoESpec(
                num_experts=num_experts,
                top_k=top_k,
                intermediate_size=reader.int("intermediate_size"),
                activation=activation,
                gated=True,
                router="softmax_topk",
                shared=shared,
            )
        position_embedding = reader.raw.get("position_embedding_type")
        if position_embedding not in (None, "rope", "nope"):
            raise reader.error(
                "position_embedding_type", f"expected null or 'rope', got {position_embedding!r}"
            )
        attention = None
        if "attention" in mixers:
            attention = attention_spec(
                reader,
                hidden,
                bias=reader.bool("attention_bias", False),
                rope_partial=1.0 if position_embedding == "rope" else None,
                scale=reader.float("attention_multiplier", 1.0, positive=True),
            )
        return HybridModelConfig(
            architecture="granitemoehybrid",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=interleave(mixers, "moe" if moe else "mlp"),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 2048),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            embedding_multiplier=reader.float("embedding_multiplier", 1.0),
            residual_multiplier=reader.float("residual_multiplier", 1.0),
            logits_divisor=reader.float("logits_scaling", 1.0, positive=True),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            mamba2=mamba_spec(reader, hidden, eps) if "mamba2" in mixers else None,
            attention=attention,
            mlp=None if moe else shared,
            moe=moe,
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
        if not is_ffn:
            if config.layer_kinds[2 * index] == "mamba2":
                return single(mamba_key(f"{layer}.mamba", param))
            return single(f"{layer}.self_attn.{param}")
        shared_renames = {
            "gate_up_proj.weight": "input_linear.weight",
            "down_proj.weight": "output_linear.weight",
        }
        if param in shared_renames:  # the dense FFN is the shared MLP
            return single(f"{layer}.shared_mlp.{shared_renames[param]}")
        if param.startswith("shared."):
            return single(f"{layer}.shared_mlp.{shared_renames[param.removeprefix('shared.')]}")
        moe = f"{layer}.block_sparse_moe"
        original, current = {
            "router.weight": ("router.layer.weight", "router.weight"),
            "experts.up": ("input_linear.weight", "experts.gate_up_proj"),
            "experts.down": ("output_linear.weight", "experts.down_proj"),
        }[param]
        return single(f"{moe}.{original}") + single(f"{moe}.{current}")
