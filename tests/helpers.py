"""Tiny builders shared by the tests: HF reference checkpoints and engine shortcuts."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any

import torch

from hybridserve.workers.cache.coordinator import CacheCoordinator, PrefixCachingConfig
from hybridserve.workers.core.request import Request
from hybridserve.workers.core.sampling_params import SamplingParams

VOCAB = 128
# A deployment's transfer secret, as the Coordinator would make it (transceiver/auth.py).
TRANSFER_SECRET = "5e" * 32


def _nemotron_h(**overrides: Any) -> Any:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(
        **(
            {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "layers_block_type": [
                    "linear_attention",
                    "moe",
                    "full_attention",
                    "mlp",
                    "linear_attention",
                    "full_attention",
                    "moe",
                ],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "intermediate_size": 96,
                "ssm_state_size": 16,
                "mamba_num_heads": 8,
                "mamba_head_dim": 8,
                "n_groups": 2,
                "chunk_size": 16,
                "n_routed_experts": 4,
                "num_experts_per_tok": 2,
                "n_group": 2,
                "topk_group": 1,
                "moe_intermediate_size": 32,
                "moe_shared_expert_intermediate_size": 48,
                # transformers clamps dt at time_step_min in its prompt path only (see
                # workers/models/nemotron_h.py); keep the clamp out of reach so both paths agree.
                "time_step_min": 1e-6,
            }
            | overrides
        )
    )
    return NemotronHForCausalLM(config)


def _bamba(**overrides: Any) -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **(
            {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "attn_layer_indices": [1, 3],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 96,
                "mamba_n_heads": 8,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_chunk_size": 16,
            }
            | overrides
        )
    )
    return BambaForCausalLM(config)


def _granite(**overrides: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        **(
            {
                "vocab_size": VOCAB,
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "layer_types": ["mamba", "attention", "mamba", "mamba"],
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 32,
                "shared_intermediate_size": 48,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "mamba_n_heads": 8,
                "mamba_n_groups": 2,
                "mamba_d_state": 16,
                "mamba_chunk_size": 16,
                "position_embedding_type": None,
                "embedding_multiplier": 6.0,
                "residual_multiplier": 0.5,
                "attention_multiplier": 1 / 16,
                "logits_scaling": 2.0,
            }
            | overrides
        )
    )
    return GraniteMoeHybridForCausalLM(config)


# Gated DeltaNet hybrids at odd shapes: head dims that are not powers of two, more value heads
# than key heads, a full-attention layer every third layer.
_GDN_SHAPES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 12,
    "linear_value_head_dim": 10,
    "linear_conv_kernel_dim": 4,
}
_GDN_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def _qwen3_next(**overrides: Any) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Layer 4 dense (mlp_only_layers), the rest MoE; top-k probabilities not renormalised.
    shapes = _GDN_SHAPES | _GDN_MOE | {"mlp_only_layers": [4], "norm_topk_prob": False}
    return Qwen3NextForCausalLM(Qwen3NextConfig(**(shapes | overrides)))


def _qwen3_5(**overrides: Any) -> Any:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**(_GDN_SHAPES | overrides)))


def _qwen3_5_moe(**overrides: Any) -> Any:
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**(_GDN_SHAPES | _GDN_MOE | overrides)))


def _qwen3_5_vl(**overrides: Any) -> Any:
    """An image-text checkpoint (vision tower and all), served as a text model."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = _GDN_SHAPES | {k: v for k, v in overrides.items() if k != "tie_word_embeddings"}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2}
    config = Qwen3_5Config(
        text_config=text,
        vision_config=vision | {"out_hidden_size": text["hidden_size"]},
        tie_word_embeddings=overrides.get("tie_word_embeddings", False),
    )
    return Qwen3_5ForConditionalGeneration(config)


def _olmo_hybrid(*, rope: bool = False, **overrides: Any) -> Any:
    """NoPE as the released checkpoints are (rope_theta null), unless `rope`. transformers
    saves the DeltaNet conv as OLMo-core's q_conv1d, k_conv1d and v_conv1d cut into equal
    thirds, right only where key_dim == value_dim: so here both are 24 (Dk 12, Dv 6)."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0 if rope else None}
    shapes = _GDN_SHAPES | {"rope_parameters": rope_parameters, "linear_value_head_dim": 6}
    return OlmoHybridForCausalLM(OlmoHybridConfig(**(shapes | overrides)))


# LFM2 at odd shapes: short convs of 3 taps between attention layers, an FFN of
# 2/3 * 90 = 60 rounded up to 64 (block_multiple_of 16).
_LFM2_SHAPES = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "layer_types": ["conv", "full_attention", "conv", "conv", "full_attention", "conv"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 90,
    "block_multiple_of": 16,
}


def _lfm2(**overrides: Any) -> Any:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM(Lfm2Config(**(_LFM2_SHAPES | overrides)))


def _lfm2_moe(**overrides: Any) -> Any:
    """One dense FFN, then 4 experts (top 2) chosen with a random expert bias; conv biases."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    shapes = {k: v for k, v in _LFM2_SHAPES.items() if k != "block_multiple_of"} | {
        "num_dense_layers": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "conv_bias": True,
    }
    model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**(shapes | overrides)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    return model


def _falcon_h1(**overrides: Any) -> Any:
    """Every muP multiplier away from 1 (each folded into other weights at load); the Mamba
    output gated without a norm, transformers' default."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    shapes = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "mamba_n_heads": 8,
        "mamba_d_ssm": 64,
        "mamba_n_groups": 2,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "embedding_multiplier": 1.5,
        "lm_head_multiplier": 0.5,
        "key_multiplier": 0.8,
        "attention_in_multiplier": 1.2,
        "attention_out_multiplier": 0.9,
        "ssm_in_multiplier": 1.1,
        "ssm_out_multiplier": 0.7,
        "ssm_multipliers": [0.9, 1.1, 1.2, 0.8, 1.3],
        "mlp_multipliers": [1.2, 0.8],
    }
    return FalconH1ForCausalLM(FalconH1Config(**(shapes | overrides)))


def _jamba(**overrides: Any) -> Any:
    """Mamba1, attention, Mamba1; the attention layer's FFN routed (4 experts, top 2)."""
    from transformers import JambaConfig, JambaForCausalLM

    shapes = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "attn_layer_period": 3,
        "attn_layer_offset": 1,
        "expert_layer_period": 3,
        "expert_layer_offset": 1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_d_state": 12,
    }
    return JambaForCausalLM(JambaConfig(**(shapes | overrides)))


def _zamba2(**overrides: Any) -> Any:
    """Three invocations of two shared blocks (the third runs the first block again), with
    attention adapters; RoPE in the shared attention."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    shapes = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 5,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "n_mamba_heads": 8,
        "mamba_d_state": 16,
        "mamba_ngroups": 2,
        "chunk_size": 16,
        "num_mem_blocks": 2,
        "use_shared_attention_adapter": True,
        "adapter_rank": 8,
        "use_mem_rope": True,
    }
    # transformers shares the blocks only with tied embeddings (as the published checkpoints
    # are); untied, each invocation would run a block of its own. Initial weights half the
    # usual: at 0.2 the shared attention's scores saturate, and transformers' own float32
    # log-probabilities stray 2e-3 from float64 (1e-5 at 0.1).
    forced = {"tie_word_embeddings": True, "initializer_range": 0.1}
    return Zamba2ForCausalLM(Zamba2Config(**(shapes | overrides | forced)))


def _kimi_linear(**overrides: Any) -> Any:
    """Kimi Delta Attention, latent attention, KDA; a dense FFN, then 4 experts (top 2, two
    groups) with a shared expert and a random correction bias."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    shapes = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse"],
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "linear_num_heads": 4,
        "linear_head_dim": 16,
        "moe_intermediate_size": 32,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
    }
    model = KimiLinearForCausalLM(KimiLinearConfig(**(shapes | overrides)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    return model


BUILDERS = {
    "nemotron_h": _nemotron_h,
    "bamba": _bamba,
    "granitemoehybrid": _granite,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_5_vl": _qwen3_5_vl,
    "olmo_hybrid": _olmo_hybrid,
    "olmo_hybrid_rope": lambda **overrides: _olmo_hybrid(rope=True, **overrides),
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "falcon_h1": _falcon_h1,
    # The Mamba2 output RMS-normed before its gate, with biases on every projection.
    "falcon_h1_norm": lambda **overrides: _falcon_h1(
        mamba_rms_norm=True,
        mamba_proj_bias=True,
        projectors_bias=True,
        attention_bias=True,
        mlp_bias=True,
        **overrides,
    ),
    "jamba": _jamba,
    "zamba2": _zamba2,
    "kimi_linear": _kimi_linear,
}
MAMBA2_ARCHITECTURES = ("nemotron_h", "bamba", "granitemoehybrid")
GDN_ARCHITECTURES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "olmo_hybrid")
ARCHITECTURES = tuple(BUILDERS)
# Checkpoint forms checked against transformers (tests/workers/test_parity.py) and at load,
# but left out of the suites that run every family: the same model in other names (Qwen3.5's
# image-text checkpoint), or a path those suites cover on another family (OLMo with RoPE,
# Falcon-H1's Mamba2 norm before its gate).
FORM_ONLY = ("qwen3_5_vl", "olmo_hybrid_rope", "falcon_h1_norm")
FAMILIES = tuple(arch for arch in ARCHITECTURES if arch not in FORM_ONLY)
# The checkpoints that cover every custom operator of the model's graph, for suites of a
# forward path rather than of a family (the compiled graph): Mamba2's conv and scan, Gated
# DeltaNet's, attention and MoE routing. The other families' features (norm placement,
# parallel sublayers, LFM2's conv, which is Mamba2's conv operator) are plain torch between them.
PATH_REPRESENTATIVES = ("nemotron_h", "qwen3_next")


def make_hf_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A seeded random fp32 transformers model with peaked logits (few near-ties)."""
    torch.manual_seed(seed)
    common = {
        "initializer_range": 0.2,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    model = BUILDERS[arch](**(common | overrides)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "dt_bias") and hasattr(module, "A_log"):
                # dt = softplus(dt_bias + ...) spread over [0.01, 0.2]: a well-conditioned scan.
                dt = 0.01 + 0.19 * torch.rand(module.dt_bias.shape, generator=generator)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            if getattr(module, "A_log", None) is not None and module.A_log.dim() == 2:
                # Mamba1 initialises every channel's decays alike: make them differ.
                module.A_log.add_(0.2 * torch.randn(module.A_log.shape, generator=generator))
    return model


def save_hf_checkpoint(model: Any, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def random_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt])
    # An explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding.
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


# A JSON schema whose every valid instance is short: structured-output tests can bound
# max_tokens and still see the grammar complete.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@torch.no_grad()
def hf_logprobs(model: Any, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), vocab) float32 log-probabilities: row i predicts token i + 1."""
    return torch.log_softmax(hf_logits(model, prompt), dim=-1)


@torch.no_grad()
def logprob_tolerance(model: Any, prompts: list[list[int]], floor: float = 1e-4) -> float:
    """How far an engine's float32 log-probabilities may be from transformers' float32 ones:
    `floor`, or twice transformers' own float32 error (against the same model in float64)
    where that is larger. An engine as accurate as transformers is within 2x its error of
    it. On the Mamba2 test models that error is ~1e-5 (the floor holds); the Gated DeltaNet
    ones normalise per value head outputs near zero at random init (the gated RMSNorm),
    which lifts float32 error to a few 1e-4 over a 300-token prompt, in transformers too."""
    exact = copy.deepcopy(model).double()
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")  # the grouped GEMM takes no float64
    error = max(
        (hf_logprobs(model, p).double() - torch.log_softmax(hf_logits(exact, p), -1))
        .abs()
        .max()
        .item()
        for p in prompts
    )
    return max(floor, 2 * error)


def engine_logprobs(llm: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The engine's (len(prompt), vocab) log-probabilities per prompt, row i predicting token
    i + 1: every prompt row through `prompt_logprobs`, the last (the first generated token's
    distribution) through `logprobs`, both over the whole vocabulary (the LLM needs
    max_logprobs=-1)."""
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=vocab, prompt_logprobs=vocab
    )
    tables = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        rows = [*output.prompt_logprobs[1:], output.logprobs[0]]
        table = torch.full((len(rows), vocab), float("nan"))
        for index, entry in enumerate(rows):
            ids, values = zip(*entry.top, strict=True)
            table[index, list(ids)] = torch.tensor(values)
        tables.append(table)
    return tables


def run_until_idle(engine: Any) -> dict[str, Any]:
    """Step an engine until idle, checking the caches (and the rank's tables) after every
    step; its finished outputs by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
    return finished


def assert_pools_at_baseline(engine: Any) -> None:
    """Integrity holds, nothing is held by a request (nor a table on the rank), and once the
    prefix cache is cleared every block and slot is free again."""
    engine.check_integrity()
    engine.apply_decided_ops()  # releases decided since the last step reach the rank
    assert not engine.executor.driver.block_tables.as_mapping()  # the rank holds no table
    cache = engine.cache
    assert cache.num_free_blocks == engine.num_kv_blocks  # cached blocks count as free
    assert cache.num_free_slots == cache.recurrent.num_live_slots
    engine.clear_cache()
    engine.check_integrity()
    assert cache.attention.pool.num_cached == 0
    assert cache.recurrent.snapshots.num_free == cache.recurrent.snapshots.ids.size
    assert next(cache.tree.nodes(), None) is None


def make_request(
    request_id: str,
    prompt_len: int = 4,
    *,
    prompt: list[int] | None = None,
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    **params: Any,
) -> Request:
    """A hand-made request as the engine would queue it; `params` go to `SamplingParams`."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)) if prompt is None else list(prompt),
        sampling_params=SamplingParams(**params),
        stop_token_ids=frozenset(stop_token_ids),
        sample_seed=seed,
    )


def make_cache(num_blocks: int, block_size: int = 4, num_slots: int = 8) -> CacheCoordinator:
    return CacheCoordinator(num_blocks=num_blocks, block_size=block_size, num_live_slots=num_slots)


def take_ops(cache: CacheCoordinator) -> list[tuple[str | int, ...]]:
    """The data moves the cache decided since the last call, as (kind, *fields) tuples."""
    return [(op.kind, *astuple(op)) for op in cache.take_ops()]


def make_prefix_cache(
    block_size: int = 32,
    num_blocks: int = 64,
    snapshots: int = 8,
    interval: int = 0,
    save_last: bool = True,
    partial: bool = True,
    *,
    live_slots: int = 2,
    offsets_from_start: tuple[int, ...] = (),
    offsets_from_end: tuple[int, ...] = (),
    host_blocks: int = 0,
    host_slots: int = 0,
) -> CacheCoordinator:
    """A coordinator with prefix caching on (its data moves: `take_ops`). Live slots are
    0..live_slots-1, snapshot slots follow them."""
    config = PrefixCachingConfig(
        enabled=True,
        snapshot_interval=interval,
        save_last_snapshot=save_last,
        partial_reuse=partial,
        offsets_from_start=offsets_from_start,
        offsets_from_end=offsets_from_end,
    )
    return CacheCoordinator(
        num_blocks=num_blocks,
        block_size=block_size,
        num_live_slots=live_slots,
        num_snapshot_slots=snapshots,
        prefix=config,
        host_blocks=host_blocks,
        host_slots=host_slots,
    )


def tokens(n: int, start: int = 1) -> list[int]:
    """`n` distinct token ids from `start`: disjoint ranges never share a prefix."""
    return list(range(start, start + n))


def assert_cache_at_baseline(cache: CacheCoordinator) -> None:
    """No request holds anything, and once cleared, the cache holds nothing either: every
    block, slot and host entry is free and the prefix tree is empty."""
    cache.check_integrity()
    assert cache.num_free_blocks == cache.attention.pool.num_blocks
    assert cache.num_free_slots == cache.recurrent.num_live_slots
    cache.clear()
    cache.check_integrity()
    assert cache.attention.pool.num_cached == 0
    assert cache.recurrent.snapshots.num_free == cache.recurrent.snapshots.ids.size
    assert next(cache.tree.nodes(), None) is None
    for host in (cache.attention.host, cache.recurrent.host):
        if host is not None:
            assert host.ids.num_free == host.ids.size


def on_new_thread_with_torch_threads(body: Callable[[], None], num_threads: int = 2) -> None:
    """Run `body` on a thread of its own (a new thread starts with OpenMP's default count)
    while torch runs on `num_threads` threads; torch's count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(before)
