"""Falcon-H1: attention and a Mamba2 mixer side by side in every layer, then a gated MLP.

    x = x + ssm_out * mamba(ssm_in * n(x)) + attn_out * attention(attn_in * n(x))
    x = x + mlp(pre_ff_layernorm(x))                       n = input_layernorm

Each decoder layer becomes three sublayers: the Mamba2 mixer, the attention (parallel: it reads
the mixer's input, HybridModelConfig.parallel_layer_ids) and the MLP; both mixers' norms load
`input_layernorm`. The family's muP multipliers are folded into the weights at load, so the
model runs none of them:

    ssm_in, ssm_multipliers (z | x | B | C | dt rows)   in_proj rows (its bias: the row factors)
    ssm_out                                              mamba out_proj
    attention_in, key_multiplier                         q, k, v (k also by key; biases by key)
    attention_out                                        o_proj
    mlp_multipliers (gate, down)                         gate_proj, down_proj
    embedding_multiplier, lm_head_multiplier             the model's own scales

The Mamba2 output meets the gate as the config says (`mamba_rms_norm`,
`mamba_norm_before_gate`): y * silu(z) without a norm by default. Attention has RoPE over the
whole head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridserve.workers.models.adapter import (
    Alternatives,
    ModelFamily,
    WeightSource,
    attention_spec,
    gate_and_up,
    model_sources,
    split_layer_name,
)
from hybridserve.workers.models.bamba import mamba_spec
from hybridserve.workers.models.config import (
    ConfigReader,
    HybridModelConfig,
    MambaGate,
    MLPSpec,
)

_SSM_SECTIONS = ("z", "x", "B", "C", "dt")


class FalconH1Adapter:
    model_types = ("falcon_h1",)
    families = (ModelFamily("Falcon-H1", model_types, (("dense", "falcon_h1", {}),)),)
    ignored_keys = None

    def parse_config(self, reader: ConfigReader) -> HybridModelConfig:
        hidden = reader.int("hidden_size")
        eps = reader.float("rms_norm_eps", 1e-5, positive=True)
        layers = reader.int("num_hidden_layers")
        if reader.activation("hidden_act", "silu") != "silu":
            raise reader.error(
                "hidden_act",
                f"must be silu (the MLP and the Mamba conv), got {reader.raw['hidden_act']!r}",
            )
        if reader.bool("mamba_proj_bias", False) != reader.bool("projectors_bias", False):
            raise reader.error(
                "projectors_bias",
                "must equal mamba_proj_bias (one bias setting for the Mamba projections)",
            )
        attention = attention_spec(
            reader, hidden, bias=reader.bool("attention_bias", False), rope_partial=1.0
        )
        multipliers = {
            "embedding": reader.float("embedding_multiplier", 1.0),
            "lm_head": reader.float("lm_head_multiplier", 1.0, positive=True),
            "key": reader.float("key_multiplier", 1.0),
            "attention_in": reader.float("attention_in_multiplier", 1.0),
            "attention_out": reader.float("attention_out_multiplier", 1.0),
            "ssm_in": reader.float("ssm_in_multiplier", 1.0),
            "ssm_out": reader.float("ssm_out_multiplier", 1.0),
        }
        multipliers |= _listed(reader, "ssm_multipliers", [f"ssm_{s}" for s in _SSM_SECTIONS])
        multipliers |= _listed(reader, "mlp_multipliers", ["mlp_gate", "mlp_down"])
        return HybridModelConfig(
            architecture="falcon_h1",
            vocab_size=reader.int("vocab_size"),
            hidden_size=hidden,
            layer_kinds=("mamba2", "attention", "mlp") * layers,
            norm_eps=eps,
            max_position_embeddings=reader.int("max_position_embeddings", 8192),
            tie_word_embeddings=reader.bool("tie_word_embeddings", False),
            embedding_multiplier=multipliers["embedding"],
            logits_divisor=1.0 / multipliers["lm_head"],
            bos_token_id=reader.raw.get("bos_token_id"),
            eos_token_ids=reader.token_ids("eos_token_id"),
            pad_token_id=reader.raw.get("pad_token_id"),
            parallel_layer_ids=tuple(3 * i + 1 for i in range(layers)),
            weight_multipliers=multipliers,
            mamba2=mamba_spec(reader, hidden, eps, self._gate(reader)),
            attention=attention,
            mlp=MLPSpec(
                intermediate_size=reader.int("intermediate_size"),
                activation="silu",
                gated=True,
                bias=reader.bool("mlp_bias", False),
            ),
        )

    @staticmethod
    def _gate(reader: ConfigReader) -> MambaGate:
        if not reader.bool("mamba_rms_norm", False):
            return "no_norm"
        before = reader.bool("mamba_norm_before_gate", True)
        return "norm_before_gate" if before else "norm_after_gate"

    def weight_sources(self, config: HybridModelConfig, name: str) -> Alternatives:
        own = model_sources(
            name, embed="model.embed_tokens.weight", final_norm="model.final_layernorm.weight"
        )
        if own is not None:
            return own
        index, part, rest = split_layer_name(name, 3)
        layer = f"model.layers.{index}"
        if rest == "norm.weight":
            norm = "pre_ff_layernorm" if part == 2 else "input_layernorm"
            return [[WeightSource(f"{layer}.{norm}.weight")]]
        param = rest.removeprefix("op.")
        scale = _scales(config, part, param)
        if part == 0:
            renames = {
                "conv_weight": "conv1d.weight",
                "conv_bias": "conv1d.bias",
                "norm_weight": "norm.weight",
            }
            key = f"{layer}.mamba.{renames.get(param, param)}"
        elif part == 1:
            key = f"{layer}.self_attn.{param}"
        elif param == "gate_up_proj.weight" or param == "gate_up_proj.bias":
            assert config.mlp is not None
            size, kind = config.mlp.intermediate_size, param.rsplit(".", 1)[1]
            gate = config.weight_multipliers["mlp_gate"]
            ffn = f"{layer}.feed_forward"
            return [
                gate_and_up(
                    f"{ffn}.gate_proj.{kind}", f"{ffn}.up_proj.{kind}", size, None, _times(gate)
                )
            ]
        else:
            key = f"{layer}.feed_forward.{param}"
        return [[WeightSource(key, transform=scale)]]


def _listed(reader: ConfigReader, field: str, names: list[str]) -> dict[str, float]:
    """A list of multipliers by name (all 1 where the config has none)."""
    value = reader.raw.get(field)
    if value is None:
        return dict.fromkeys(names, 1.0)
    if not isinstance(value, list) or len(value) != len(names):
        raise reader.error(field, f"expected {len(names)} numbers, got {value!r}")
    numbers = [ConfigReader({field: v}, reader.file).float(field) for v in value]
    return dict(zip(names, numbers, strict=True))


def _times(factor: float | torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Scale a tensor (by rows where `factor` is a vector), in float32; None for 1."""
    if isinstance(factor, float):
        return None if factor == 1.0 else lambda t: t.float() * factor
    return lambda t: t.float() * (factor[:, None] if t.dim() == 2 else factor)


def _scales(
    config: HybridModelConfig, part: int, param: str
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What multiplies a checkpoint tensor of layer part `part` (0 Mamba, 1 attention, 2 MLP)
    once the family's multipliers are folded in."""
    m = config.weight_multipliers
    weight = param.endswith(".weight")
    if part == 0 and param.startswith("in_proj."):
        spec = config.mamba2
        assert spec is not None
        inner, groups = spec.intermediate_size, spec.group_state_size
        rows = [inner, inner, groups, groups, spec.num_heads]
        factor = torch.cat(
            [torch.full((n,), m[f"ssm_{s}"]) for n, s in zip(rows, _SSM_SECTIONS, strict=True)]
        )
        return _times(factor * m["ssm_in"] if weight else factor)
    if part == 0 and param.startswith("out_proj."):
        return _times(m["ssm_out"])
    if part == 1:
        projection = param.split(".", 1)[0]
        factor = {
            "q_proj": m["attention_in"] if weight else 1.0,
            "k_proj": m["key"] * (m["attention_in"] if weight else 1.0),
            "v_proj": m["attention_in"] if weight else 1.0,
            "o_proj": m["attention_out"],
        }[projection]
        return _times(factor)
    if part == 2 and param.startswith("down_proj."):
        return _times(m["mlp_down"])
    return None
