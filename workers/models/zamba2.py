"""Zamba2: a Mamba2 backbone with shared transformer blocks invoked at several depths.

`layers_block_type` lists the layers: a Mamba2 layer ("mamba", "linear_attention") is one
sublayer; a "hybrid" layer is an invocation of a shared block (layers/shared_block.py) whose
output joins the Mamba2 sublayer after it, x + mamba(norm(x + block(x, embeddings))).
Invocation j runs block j % num_mem_blocks; its attention reads [hidden | embeddings] (twice
the hidden size, head_dim = 2 * hidden / heads, scaled by (head_dim / 2)^-1/2, RoPE only with
`use_mem_rope`). Each block's weights are stored under the first hybrid layer that runs it,
and may be saved again under the later ones; invocation j's adapters sit in its block's lists
at index j. transformers ties the blocks only together with the embeddings
(`tie_word_embeddings`): untied, every hybrid layer runs its own saved copy, and so does this
adapter (one block per invocation).

The Mamba2 mixer normalises its gated output per group with epsilon 1e-5 and clamps dt below at
`time_step_min`.
"""

from __future__ import annotations

import re

from hybridserve.workers.models.adapter import (
    LAYER_NAME,
    Alternatives,
    ModelFamily,
    WeightSource,
    attention_spec,
    check_mamba,
    mamba_key,
    model_sources,
    rope_spec,
    single,
)
from hybridserve.workers.models.config import (
    AttentionSpec,
    ConfigReader,
    HybridModelConfig,
    LayerKind,
    MambaSpec,
    MLPSpec,
    SharedBlockSpec,
    parse_layer_names,
)

_LAYER_TYPES: dict[str, LayerKind] = {
    "mamba": "mamba2",
    "linear_attention": "mamba2",
    "hybrid": "shared_block",
}
_BLOCK_RENAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight",
}


def _layer_of(config: HybridModelConfig, sublayer: int) -> int:
    """The checkpoint layer of a sublayer: every checkpoint layer ends with one Mamba2."""
    return config.layer_kinds[:sublayer].count("mamba2")


class Zamba2Adapter:
    model_types = ("zamba2",)
    families = (ModelFamily("Zamba2", model_types, (("dense", "zamba2", {}),)),)
    # A block's weights are saved again under each later hybrid layer that runs it (tied
    # copies, adapters included); the first copy is the one read.
    ignored_keys = re.compile(r"^model\.layers\.\d+\.shared_transformer\.")

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-5, positive=True)
        layers = parse_layer_names(
            reader, "layers_block_type", {"mamba2", "shared_block"}, _LAYER_TYPES, counted=True
        )
        kinds: list[LayerKind] = []
        for kind in layers:
            kinds += ["shared_block", "mamba2"] if kind == "shared_block" else ["mamba2"]
        blocks = "shared_block" in kinds
        return HybridModelConfig(
            architecture="zamba2",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=tuple(kinds),
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 4096),
            tie_word_embeddings=reader.bool("tie_word_embeddings", True),
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            mamba2=self._mamba(reader, hidden),
            attention=self._attention(reader, hidden) if blocks else None,
            shared_block=self._shared_block(reader, hidden, kinds.count("shared_block"))
            if blocks
            else None,
        )

    @staticmethod
    def _mamba(reader: ConfigReader, hidden: int) -> MambaSpec:
        heads = reader.int("n_mamba_heads", 8)
        inner = reader.int("mamba_expand", 2) * hidden
        if inner % heads:
            raise reader.error(
                "n_mamba_heads", f"{heads} does not divide the Mamba inner size {inner}"
            )
        spec = MambaSpec(
            num_heads=heads,
            head_dim=inner // heads,
            state_size=reader.int("mamba_d_state", 64),
            n_groups=reader.int("mamba_ngroups", 1),
            conv_kernel=reader.int("mamba_d_conv", 4, minimum=2),
            chunk_size=reader.int("chunk_size", 256),
            conv_bias=reader.bool("use_conv_bias", True),
            proj_bias=reader.bool("add_bias_linear", False),
            activation="silu",
            norm_eps=1e-5,  # the mixer's gated norm: fixed, whatever rms_norm_eps says
            dt_min=reader.float("time_step_min", 0.001),
        )
        check_mamba(
            reader,
            spec,
            heads_field="n_mamba_heads",
            groups_field="mamba_ngroups",
            activation_field="hidden_act",
        )
        return spec

    @staticmethod
    def _attention(reader: ConfigReader, hidden: int) -> AttentionSpec:
        heads = reader.int("num_attention_heads")
        head_dim = 2 * hidden // heads
        if head_dim * heads != 2 * hidden:
            raise reader.error(
                "num_attention_heads", f"{heads} does not divide twice the hidden size {hidden}"
            )
        spec = attention_spec(reader, hidden, bias=False, rope_partial=None)
        adapters = reader.bool("use_shared_attention_adapter", False)
        if adapters and spec.num_kv_heads != heads:
            raise reader.error(
                "num_key_value_heads",
                f"{spec.num_kv_heads}: the shared attention adapters add a full-width term to "
                f"k and v, which needs num_attention_heads ({heads}) key-value heads",
            )
        rope = rope_spec(reader, head_dim, 1.0) if reader.bool("use_mem_rope", False) else None
        return spec.model_copy(
            update={
                "head_dim": head_dim,
                "scale": (head_dim / 2) ** -0.5,
                "rope": rope,
                "input_size": 2 * hidden,
            }
        )

    @staticmethod
    def _shared_block(reader: ConfigReader, hidden: int, invocations: int) -> SharedBlockSpec:
        tied = reader.bool("tie_word_embeddings", True)
        return SharedBlockSpec(
            num_blocks=reader.int("num_mem_blocks", 1) if tied else invocations,
            adapter_rank=reader.int("adapter_rank", 128),
            attention_adapters=reader.bool("use_shared_attention_adapter", False),
            mlp=MLPSpec(
                intermediate_size=reader.int("intermediate_size", 4 * hidden),
                activation=reader.activation("hidden_act", "gelu"),
                gated=True,
                bias=reader.bool("add_bias_linear", False),
            ),
        )

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(
            name, embed="model.embed_tokens.weight", final_norm="model.final_layernorm.weight"
        )
        if own is not None:
            return own
        invocations = [i for i, kind in enumerate(config.layer_kinds) if kind == "shared_block"]
        if name.startswith("shared_blocks."):
            # Block b first runs at invocation b.
            block, _, param = name.removeprefix("shared_blocks.").partition(".")
            prefix = f"model.layers.{_layer_of(config, invocations[int(block)])}"
            return single(self._block_key(f"{prefix}.shared_transformer", param))
        match = LAYER_NAME.fullmatch(name)
        assert match is not None, name
        sublayer, param = int(match[1]), match[2]
        layer = _layer_of(config, sublayer)
        if config.layer_kinds[sublayer] == "shared_block":
            return self._invocation_sources(config, invocations, sublayer, param)
        prefix = f"model.layers.{layer}"
        if sublayer and config.layer_kinds[sublayer - 1] == "shared_block":
            prefix += ".mamba_decoder"
        if param == "norm.weight":
            return single(f"{prefix}.input_layernorm.weight")
        return single(mamba_key(f"{prefix}.mamba", param.removeprefix("op.")))

    @staticmethod
    def _block_key(block: str, param: str) -> str:
        """A shared block's parameter (attention.*, mlp.*, the norms) in the checkpoint."""
        if param in _BLOCK_RENAMES:
            return f"{block}.{_BLOCK_RENAMES[param]}"
        if param.startswith("attention."):
            return f"{block}.self_attn.{param.removeprefix('attention.')}"
        assert param.startswith("mlp."), param
        return f"{block}.feed_forward.{param.removeprefix('mlp.')}"

    @staticmethod
    def _invocation_sources(
        config: HybridModelConfig, invocations: list[int], sublayer: int, param: str
    ) -> Alternatives:
        """Invocation j's own parameters: the output linear, and its adapters, kept at index j
        of its block's adapter lists (in its own layer's copy of the block, or in the first
        where later copies were not saved)."""
        spec = config.shared_block
        assert spec is not None
        j = invocations.index(sublayer)
        param = param.removeprefix("op.")
        layer = _layer_of(config, sublayer)
        if param == "linear.weight":
            return single(f"model.layers.{layer}.linear.weight")
        adapter, _, rest = param.partition(".")  # qkv_adapters.{0,1,2} or up_adapter
        if adapter == "up_adapter":
            lists = f"feed_forward.gate_up_proj_adapter_list.{j}"
        else:
            index, _, rest = rest.partition(".")
            lists = f"self_attn.linear_{'qkv'[int(index)]}_adapter_list.{j}"
        part = {"down.weight": "0.weight", "up.weight": "1.weight"}[rest]
        first = _layer_of(config, invocations[j % spec.num_blocks])
        return [
            [WeightSource(f"model.layers.{copy}.shared_transformer.{lists}.{part}")]
            for copy in dict.fromkeys((layer, first))
        ]
