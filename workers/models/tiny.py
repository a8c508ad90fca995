"""The built-in `tiny` model: a small NemotronH-style hybrid that needs no files.

Seeded random weights in HF NemotronH layout (`backbone.*`), a byte-level tokenizer (token id =
byte value, plus three special tokens) and a ChatML-style chat template. `write_tiny_checkpoint`
saves exactly this as an HF-format folder that `transformers` can load too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from hybridserve.workers.core.tokenizer import Tokenizer
from hybridserve.workers.models.loader import Checkpoint, MemorySource

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258

# ChatML turns; with tools, a system turn lists them and calls are written hermes-style, as
# Qwen3-Next's are: <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Without tools the
# rendering is plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "Functions you may call, one JSON object each:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>\n{"name": NAME, "arguments": ARGUMENTS}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '\n<tool_call>\n' + {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson + '\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 256 + len(SPECIAL_TOKENS),
    "hidden_size": 128,
    "hybrid_override_pattern": "M*-M*-M-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "ssm_state_size": 32,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 64,
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    # transformers clamps dt at time_step_min in its prompt path only; keep that clamp idle.
    "time_step_min": 1e-6,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "torch_dtype": "float32",
}

TINY_SEED = 20260101


def _byte_to_unicode() -> dict[int, str]:
    """Byte-level BPE's printable stand-in character for each byte value."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def tiny_tokenizer_backend() -> BackendTokenizer:
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return backend


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(
        tiny_tokenizer_backend(), chat_template=CHAT_TEMPLATE, eos_token=SPECIAL_TOKENS[0]
    )


def tiny_weights() -> dict[str, torch.Tensor]:
    """Seeded weights under HF NemotronH names, scaled so activations stay O(1)."""
    c = TINY_CONFIG
    gen = torch.Generator().manual_seed(TINY_SEED)
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    heads, head_dim = c["mamba_num_heads"], c["mamba_head_dim"]
    inner = heads * head_dim
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)

    # Output rows of printable ASCII are ten times larger, so even random weights "write" text.
    printable = torch.full((vocab, 1), 0.1)
    printable[ord(" ") : ord("~") + 1] = 1.0
    weights = {
        "backbone.embeddings.weight": torch.randn(vocab, hidden, generator=gen),
        "backbone.norm_f.weight": torch.ones(hidden),
        "lm_head.weight": linear(vocab, hidden) * 4.0 * printable,
    }
    for index, symbol in enumerate(c["hybrid_override_pattern"]):
        layer = f"backbone.layers.{index}"
        weights[f"{layer}.norm.weight"] = torch.ones(hidden)
        mixer = f"{layer}.mixer"
        if symbol == "M":
            dt = torch.exp(
                torch.rand(heads, generator=gen) * (math.log(0.1) - math.log(0.001))
                + math.log(0.001)
            )
            weights |= {
                f"{mixer}.in_proj.weight": linear(inner + conv_dim + heads, hidden),
                f"{mixer}.conv1d.weight": (
                    torch.rand(conv_dim, 1, c["conv_kernel"], generator=gen) * 2 - 1
                )
                / math.sqrt(c["conv_kernel"]),
                f"{mixer}.conv1d.bias": torch.zeros(conv_dim),
                f"{mixer}.dt_bias": dt + torch.log(-torch.expm1(-dt)),  # inverse softplus
                f"{mixer}.A_log": torch.log(1 + 15 * torch.rand(heads, generator=gen)),
                f"{mixer}.D": torch.ones(heads),
                f"{mixer}.norm.weight": torch.ones(inner),
                f"{mixer}.out_proj.weight": linear(hidden, inner),
            }
        elif symbol == "*":
            q_size = c["num_attention_heads"] * c["head_dim"]
            kv_size = c["num_key_value_heads"] * c["head_dim"]
            weights |= {
                f"{mixer}.q_proj.weight": linear(q_size, hidden),
                f"{mixer}.k_proj.weight": linear(kv_size, hidden),
                f"{mixer}.v_proj.weight": linear(kv_size, hidden),
                f"{mixer}.o_proj.weight": linear(hidden, q_size),
            }
        else:
            weights |= {
                f"{mixer}.up_proj.weight": linear(c["intermediate_size"], hidden),
                f"{mixer}.down_proj.weight": linear(hidden, c["intermediate_size"]),
            }
    return weights


def tiny_checkpoint() -> Checkpoint:
    return Checkpoint(
        name="tiny",
        raw_config=dict(TINY_CONFIG),
        config_file="tiny/config.json",
        tensors=MemorySource(tiny_weights()),
        tokenizer=tiny_tokenizer(),
    )


def write_tiny_checkpoint(folder: str | Path) -> Path:
    """Write `tiny` as an HF-format checkpoint folder; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in tiny_weights().items()},
        str(folder / "model.safetensors"),
        metadata={"format": "pt"},
    )
    tiny_tokenizer_backend().save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return folder
