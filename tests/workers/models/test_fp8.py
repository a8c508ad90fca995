"""FP8 checkpoints: block-wise (`quant_method: fp8`) and compressed-tensors (per-channel and
per-tensor scales), written by this test's own quantizer in each format's file layout. Oracle:
the engine on the dequantised float weights, written separately (q * scale, computed here), must
give the same greedy tokens, batched and alone, with prefix reuse on, whether the engine keeps
the weights FP8 (its FP8 GEMMs) or dequantises them at load, and across tensor-parallel ranks
(each holding its rows, or its whole groups of columns, with their scales)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.layers.attention import Attention
from hybridserve.workers.layers.gated_deltanet import GatedDeltaNet
from hybridserve.workers.models.config import ConfigError, WeightError
from tests.fp8 import FORMATS, compressed_tensors, write_pair
from tests.helpers import assert_pools_at_baseline, make_hf_model, random_prompts

DYNAMIC_KV = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": True}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def source(request, tmp_path_factory) -> Path:
    """A float checkpoint: NemotronH (Mamba2, MoE experts per expert) or Qwen3-Next (Gated
    DeltaNet with the fused per-key-head projections, gated attention, MoE)."""
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(folder)
    return folder


def fp8_parameters(llm: LLM) -> int:
    model = llm.engine.executor.driver.model
    return sum(p.dtype == torch.float8_e4m3fn for p in model.parameters())


# Every layout held FP8; dequantising at load reads the same scales, so one layout checks it.
@pytest.mark.parametrize(
    ("kind", "fp8_weights"), [*((kind, "keep") for kind in FORMATS), ("block", "dequantize")]
)
def test_an_fp8_checkpoint_gives_the_tokens_of_its_dequantised_weights(
    source, kind, fp8_weights, tmp_path
):
    fp8, dequantised = write_pair(source, tmp_path, kind)
    prompts = random_prompts([5, 40, 90], seed=4)
    again = [[*prompts[2], 7, 8]]  # reuses the third prompt's snapshot
    with LLM(str(dequantised), snapshot_interval=32) as reference:
        expected = [o.token_ids for o in reference.generate(prompts + again, GREEDY)]
    with LLM(str(fp8), snapshot_interval=32, fp8_weights=fp8_weights) as llm:
        # Every quantized projection and expert stack stays FP8, or none does; DeltaNet's
        # in_proj stays FP8 beside its float b and a (a separate layer, as the checkpoints
        # quantize them).
        assert (fp8_parameters(llm) > 10) == (fp8_weights == "keep")
        for module in llm.engine.executor.driver.model.modules():
            if isinstance(module, GatedDeltaNet):
                kept = module.in_proj.weight.dtype == torch.float8_e4m3fn
                assert kept == (fp8_weights == "keep")
                assert module.in_proj_ba.weight.dtype == torch.float32
        together = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        (reused,) = llm.generate(again, GREEDY)
        assert together == alone == expected[:3]
        assert reused.token_ids == expected[3] and reused.num_cached_tokens > 0
        assert_pools_at_baseline(llm.engine)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_weights_split_over_tensor_parallel_ranks(source, expert_parallel, tmp_path):
    fp8, dequantised = write_pair(source, tmp_path, "block")
    prompts = random_prompts([5, 70], seed=6)
    common = {"snapshot_interval": 32, "tensor_parallel_size": 2}
    common |= {"enable_expert_parallel": expert_parallel}
    with LLM(str(dequantised), **common) as reference:
        expected = [o.token_ids for o in reference.generate(prompts, GREEDY)]
    with LLM(str(fp8), fp8_weights="keep", **common) as llm:
        assert fp8_parameters(llm) > 10
        # Each rank's shard in storage of its own: the full checkpoint tensor is not kept.
        model = llm.engine.executor.driver.model
        assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
        assert_pools_at_baseline(llm.engine)


def test_a_missing_scale_and_an_fp8_tensor_without_a_config_are_refused(source, tmp_path):
    fp8, _ = write_pair(source, tmp_path, "channel")
    tensors = load_file(str(fp8 / "model.safetensors"))
    scale = next(name for name in tensors if name.endswith("weight_scale"))
    del tensors[scale]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(WeightError, match=f"'{scale}': missing: the FP8 weight's scales"):
        LLM(str(fp8))
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError, match=r"float8_e4m3fn, but config\.json declares no"):
        LLM(str(fp8))


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq' is not supported"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes' is not"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt' is not supported"),
        ({"quant_method": "fp8", "fmt": "e4m3"}, "per-tensor fp8 without weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         "static activation scales"),
        (compressed_tensors("tensor") | {"format": "pack-quantized"},
         "format 'pack-quantized': only float-quantized"),
        (compressed_tensors("group"), "strategy 'group': only tensor or channel"),
        (compressed_tensors("tensor") | {"kv_cache_scheme": DYNAMIC_KV},
         "kv_cache_scheme: only float 8-bit static per-tensor scales"),
    ],
)  # fmt: skip
def test_a_quantization_that_does_not_load_is_refused_naming_it(source, quantization, named):
    config = json.loads((source / "config.json").read_text())
    folder = source.parent / f"refused-{abs(hash(json.dumps(quantization))) % 10**8}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}))
    weights = folder / "model.safetensors"
    if not weights.exists():
        weights.symlink_to(source / "model.safetensors")
    with pytest.raises(ConfigError) as refused:
        LLM(str(folder))
    message = str(refused.value)
    assert "field 'quantization_config'" in message and named in message
    assert "block-wise FP8" in message  # the supported formats are listed


def with_kv_scales(fp8: Path, k_scale: float, v_scale: float) -> Path:
    """`fp8` (compressed-tensors) with a kv_cache_scheme and every attention layer's k_scale
    and v_scale, as llm-compressor writes them beside `self_attn.q_proj`."""
    folder = fp8.parent / f"{fp8.name}-kv"
    folder.mkdir()
    config = json.loads((fp8 / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    config["quantization_config"]["kv_cache_scheme"] = scheme | {"symmetric": True}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(fp8 / "model.safetensors"))
    for key in [k for k in tensors if k.endswith("q_proj.weight")]:
        prefix = key.removesuffix("q_proj.weight")
        tensors[prefix + "k_scale"] = torch.tensor(k_scale)
        tensors[prefix + "v_scale"] = torch.tensor(v_scale)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_the_checkpoints_kv_scales_scale_an_fp8_kv_cache(source, tmp_path):
    """The FP8 cache holds k / k_scale and v / v_scale; powers of two change no e4m3 digit
    (but for values that cross the subnormal range), so the tokens are the unscaled cache's
    and the log-probabilities within 1e-2 (2e-3 seen), where a scale applied on one side only
    fails. A float cache ignores the scales: exactly the checkpoint without them."""
    fp8, _ = write_pair(source, tmp_path, "channel")
    scaled = with_kv_scales(fp8, 0.25, 2.0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = random_prompts([5, 40, 90], seed=9)
    runs = {}
    for name, folder, options in [
        ("fp8 kv", fp8, {"kv_cache_dtype": "fp8"}),
        ("fp8 kv scaled", scaled, {"kv_cache_dtype": "fp8"}),
        ("float kv", fp8, {}),
        ("float kv, scales ignored", scaled, {}),
    ]:
        with LLM(str(folder), **options) as llm:
            runs[name] = llm.generate(prompts, params)
            attention = [m for m in llm.engine.executor.driver.model.modules()
                         if isinstance(m, Attention)]  # fmt: skip
            expected_scales = (0.25, 2.0) if folder == scaled else (1.0, 1.0)
            assert attention and all((m.k_scale, m.v_scale) == expected_scales for m in attention)
    for ours, reference in zip(runs["fp8 kv scaled"], runs["fp8 kv"], strict=True):
        assert ours.token_ids == reference.token_ids
        for mine, theirs in zip(ours.logprobs, reference.logprobs, strict=True):
            assert abs(mine.logprob - theirs.logprob) <= 1e-2
    ignored, plain = runs["float kv, scales ignored"], runs["float kv"]
    assert [o.token_ids for o in ignored] == [o.token_ids for o in plain]
    assert [o.logprobs for o in ignored] == [o.logprobs for o in plain]
