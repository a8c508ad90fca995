"""Checkpoint loading: the written tiny checkpoint, named weight/config errors, expert layouts,
and tensor-parallel slicing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.models.config import ConfigError, WeightError
from hybridserve.workers.models.hybrid import HybridForCausalLM
from hybridserve.workers.models.loader import load_model, open_checkpoint
from hybridserve.workers.models.tiny import tiny_checkpoint, write_tiny_checkpoint
from tests.helpers import ARCHITECTURES, hf_greedy, make_hf_model

SMALL = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 64}
PROMPTS = [list(b"hello world"), list(b"The quick brown fox"), [257, *b"user\nhi", 258]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def load(folder: Path, parallel: ParallelContext | None = None) -> HybridForCausalLM:
    return load_model(
        open_checkpoint(str(folder)), dtype=torch.float32, device="cpu", parallel=parallel
    )


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tiny_copy(tiny_folder, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "tiny"))


def rewrite_weights(folder: Path, change) -> None:
    file = folder / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


# ---- the tiny checkpoint ------------------------------------------------------------------


def test_written_tiny_checkpoint_has_the_built_in_weights(tiny_folder):
    ours = parameters(load(tiny_folder))
    built_in = parameters(load_model(tiny_checkpoint(), dtype=torch.float32, device="cpu"))
    assert ours.keys() == built_in.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, built_in[name]), name


def test_written_tiny_checkpoint_generates_like_the_built_in_and_like_transformers(tiny_folder):
    from transformers import AutoModelForCausalLM

    from_folder = LLM(str(tiny_folder), **SMALL).generate(PROMPTS, GREEDY)
    built_in = LLM("tiny", **SMALL).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in from_folder] == [o.token_ids for o in built_in]
    assert [o.text for o in from_folder] == [o.text for o in built_in]

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    assert type(hf).__name__ == "NemotronHForCausalLM"
    for prompt, output in zip(PROMPTS, from_folder, strict=True):
        assert output.token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


# ---- errors -------------------------------------------------------------------------------


def test_a_missing_tensor_names_the_file_and_the_key(tiny_copy):
    key = "backbone.layers.3.mixer.A_log"
    rewrite_weights(tiny_copy, lambda tensors: tensors.pop(key))
    with pytest.raises(WeightError) as info:
        LLM(str(tiny_copy), **SMALL)
    assert (info.value.file, info.value.field) == ("model.safetensors", key)
    assert str(info.value).startswith(f"model.safetensors: weight '{key}': missing")
    assert "layers.3.op.A_log" in str(info.value)  # the parameter it was needed for


@pytest.mark.parametrize(
    ("key", "bad_shape", "good_shape"),
    [
        ("backbone.layers.0.mixer.D", (9,), (8,)),
        ("backbone.layers.1.mixer.k_proj.weight", (32, 128), (64, 128)),
        ("lm_head.weight", (259, 64), (259, 128)),
    ],
)
def test_a_wrong_shape_names_the_file_the_key_and_both_shapes(
    tiny_copy, key, bad_shape, good_shape
):
    def change(tensors):
        tensors[key] = torch.zeros(bad_shape)

    rewrite_weights(tiny_copy, change)
    with pytest.raises(WeightError) as info:
        LLM(str(tiny_copy), **SMALL)
    assert str(info.value) == (
        f"model.safetensors: weight '{key}': shape {list(bad_shape)} does not match the "
        f"{list(good_shape)} that config.json implies"
    )


def test_errors_in_a_sharded_checkpoint_name_the_shard(tiny_copy):
    tensors = load_file(str(tiny_copy / "model.safetensors"))
    (tiny_copy / "model.safetensors").unlink()
    keys = sorted(tensors)
    bad = "backbone.layers.6.mixer.dt_bias"
    assert bad in keys[len(keys) // 2 :]
    tensors[bad] = torch.zeros(3)
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({k: tensors[k] for k in keys[: len(keys) // 2]}, str(tiny_copy / first))
    save_file({k: tensors[k] for k in keys[len(keys) // 2 :]}, str(tiny_copy / second))
    with pytest.raises(WeightError, match=rf"^{second}: weight '{bad}': shape \[3\]"):
        LLM(str(tiny_copy), **SMALL)


def test_a_checkpoint_without_weight_files_is_named(tiny_copy):
    (tiny_copy / "model.safetensors").unlink()
    with pytest.raises(WeightError, match="no weight files in the checkpoint"):
        LLM(str(tiny_copy), **SMALL)


@pytest.mark.parametrize(
    ("text", "message"), [("{not json", "not valid JSON"), ("[1, 2]", "expected a JSON object")]
)
def test_a_broken_config_json_is_a_config_error(tiny_copy, text, message):
    (tiny_copy / "config.json").write_text(text)
    with pytest.raises(ConfigError) as info:
        LLM(str(tiny_copy), **SMALL)
    assert str(tiny_copy / "config.json") in str(info.value)
    assert message in str(info.value)


def test_a_config_error_names_the_checkpoint_file(tiny_copy):
    config = json.loads((tiny_copy / "config.json").read_text())
    config["hidden_size"] = "wide"
    (tiny_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"config\.json: field 'hidden_size': expected an int"):
        LLM(str(tiny_copy), **SMALL)


def test_a_missing_folder_says_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        LLM(str(tmp_path / "nowhere"), **SMALL)
    assert "nowhere" in str(info.value)
    assert "'tiny'" in str(info.value)


def test_a_tensor_the_model_does_not_use_is_refused_by_name_and_known_extras_load(tiny_copy):
    """A checkpoint the model does not consume entirely would answer with wrong tokens; the
    multi-token prediction head NemotronH checkpoints carry is skipped knowingly."""
    rewrite_weights(
        tiny_copy, lambda tensors: tensors.update({"mtp.layers.0.norm.weight": torch.zeros(2)})
    )
    load(tiny_copy)
    rewrite_weights(
        tiny_copy,
        lambda tensors: tensors.update({"backbone.layers.0.mixer.surprise": torch.zeros(2)}),
    )
    with pytest.raises(WeightError) as refused:
        load(tiny_copy)
    message = str(refused.value)
    assert "model.safetensors: weight 'backbone.layers.0.mixer.surprise'" in message
    assert "does not use 1 of the checkpoint's tensors" in message


# Quantized layouts that do not load, as checkpoints declare them, each with the scales it
# carries: compressed-tensors without its scheme, AWQ. (FP8 that loads, and more refusals:
# test_fp8.py.)
QUANTIZED = {
    "compressed-tensors": (
        {"quant_method": "compressed-tensors", "format": "float-quantized"},
        "weight_scale",
    ),
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128}, "scales"),
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_a_quantized_checkpoint_is_refused_naming_its_method(tiny_copy, method):
    quantization, scale = QUANTIZED[method]
    config_file = tiny_copy / "config.json"
    config_file.write_text(
        json.dumps(json.loads(config_file.read_text()) | {"quantization_config": quantization})
    )
    rewrite_weights(
        tiny_copy,
        lambda tensors: tensors.update({f"backbone.layers.0.mixer.in_proj.{scale}": torch.ones(1)}),
    )
    for attempt in (lambda: open_checkpoint(str(tiny_copy)), lambda: LLM(str(tiny_copy))):
        with pytest.raises(ConfigError) as refused:
            attempt()
        assert f"field 'quantization_config': quantization method '{method}'" in str(refused.value)


def test_scales_of_weights_that_are_not_quantized_are_refused_as_unused(tiny_copy):
    """A block-FP8 config whose in_proj is stored in float: its scales are not read."""
    config_file = tiny_copy / "config.json"
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config_file.write_text(
        json.dumps(json.loads(config_file.read_text()) | {"quantization_config": fp8})
    )
    rewrite_weights(
        tiny_copy,
        lambda tensors: tensors.update(
            {"backbone.layers.0.mixer.in_proj.weight_scale_inv": torch.ones(1)}
        ),
    )
    with pytest.raises(WeightError, match=r"in_proj\.weight_scale_inv"):
        load(tiny_copy)


def test_stray_scale_tensors_without_a_quantization_config_are_refused_too(tiny_copy):
    rewrite_weights(
        tiny_copy,
        lambda tensors: tensors.update(
            {"backbone.layers.0.mixer.in_proj.weight_scale_inv": torch.ones(1)}
        ),
    )
    with pytest.raises(WeightError, match=r"in_proj\.weight_scale_inv"):
        load(tiny_copy)


# ---- NemotronH expert layouts -------------------------------------------------------------


@pytest.fixture(scope="module")
def nemotron_folders(tmp_path_factory) -> tuple[Path, Path]:
    """The same NemotronH model saved per-expert under `backbone.` (what save_pretrained
    writes) and fused 3-D under `model.` (the in-memory transformers layout)."""
    model = make_hf_model("nemotron_h")
    per_expert = tmp_path_factory.mktemp("nemotron-per-expert")
    model.save_pretrained(per_expert)
    fused = tmp_path_factory.mktemp("nemotron-fused")
    shutil.copy(per_expert / "config.json", fused / "config.json")
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(fused / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return per_expert, fused


def test_per_expert_and_fused_expert_checkpoints_load_identically(nemotron_folders):
    per_expert, fused = nemotron_folders
    per_expert_keys = set(load_file(str(per_expert / "model.safetensors")))
    fused_tensors = load_file(str(fused / "model.safetensors"))
    # The two files really differ in layout.
    assert "backbone.layers.1.mixer.experts.0.up_proj.weight" in per_expert_keys
    assert fused_tensors["model.layers.1.mixer.experts.up_proj"].shape == (4, 32, 64)
    assert fused_tensors["model.layers.1.mixer.experts.down_proj"].shape == (4, 64, 32)
    assert not any(k.startswith("backbone.") for k in fused_tensors)

    a, b = parameters(load(per_expert)), parameters(load(fused))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(
        a["layers.1.op.experts.up"][2],
        fused_tensors["model.layers.1.mixer.experts.up_proj"][2],
    )


# ---- tensor-parallel slicing --------------------------------------------------------------


@pytest.fixture(scope="module", params=ARCHITECTURES)
def hf_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param).save_pretrained(folder)
    return request.param, folder


class NoCollectives:
    """Loading never communicates; a forward pass would."""

    def all_reduce(self, tensor):
        raise AssertionError("no collectives while loading")

    gather_to_driver = all_reduce


def rank_parameters(folder: Path, tp: int, expert_parallel: bool = False) -> list[dict]:
    return [
        parameters(load(folder, ParallelContext(tp, rank, expert_parallel, NoCollectives())))
        for rank in range(tp)
    ]


def reassemble(reference: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """The full parameter rebuilt from every rank's part at the ranges it records; asserts
    every row is covered and replicated rows agree."""
    dim = parts[0].shard_dim
    rebuilt = torch.full_like(reference, float("nan"))
    for part in parts:
        assert part.shard_dim == dim
        offset_in_part = 0
        for offset, length in part.shard_ranges:
            real = max(0, min(length, reference.shape[dim] - offset))  # vocab padding
            piece = part.narrow(dim, offset_in_part, real)
            target = rebuilt.narrow(dim, offset, real)
            assert target.isnan().all() or torch.equal(target, piece), "replicas disagree"
            target.copy_(piece)
            assert (part.narrow(dim, offset_in_part + real, length - real) == 0).all()
            offset_in_part += length
        assert offset_in_part == part.shape[dim]
    assert not rebuilt.isnan().any(), "rows no rank holds"
    return rebuilt


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-moe", "ep"])
def test_tp_ranks_hold_slices_that_reassemble_the_full_parameters(hf_checkpoint, expert_parallel):
    _, hf_folder = hf_checkpoint
    full = parameters(load(hf_folder))
    ranks = rank_parameters(hf_folder, 2, expert_parallel)
    shard_dims = set()
    for name, reference in full.items():
        parts = [rank[name] for rank in ranks]
        if getattr(parts[0], "shard_dim", None) is None:  # replicated: every rank holds it
            for part in parts:
                assert torch.equal(part, reference), name
            continue
        shard_dims.add(parts[0].shard_dim)
        assert torch.equal(reassemble(reference, parts), reference), name
        if reference.unique().numel() > 1:  # zero biases and unit norms look alike anyway
            assert not torch.equal(parts[0], parts[1]), name
    # Column (0), row (1) and, with TP-MoE, expert-down (2) splits all occurred; expert
    # parallelism splits experts along dim 0.
    assert {0, 1} <= shard_dims
    if any(".experts." in name for name in full):
        assert (2 in shard_dims) == (not expert_parallel)


def test_replicated_kv_heads_and_groups_give_every_rank_the_ones_its_heads_read(tmp_path):
    """One KV head and one Mamba group over 2 ranks: both ranks hold the same K/V rows and
    B/C rows, their own halves of the query heads and Mamba heads."""
    folder = tmp_path / "mqa"
    make_hf_model("nemotron_h", num_key_value_heads=1, n_groups=1).save_pretrained(folder)
    full = parameters(load(folder))
    ranks = rank_parameters(folder, 2)
    for name in ("layers.2.op.k_proj.weight", "layers.2.op.v_proj.weight"):
        assert torch.equal(ranks[0][name], full[name]) and torch.equal(ranks[1][name], full[name])
    q = full["layers.2.op.q_proj.weight"]
    assert torch.equal(torch.cat([r["layers.2.op.q_proj.weight"] for r in ranks]), q)
    in_proj = full["layers.0.op.in_proj.weight"]  # z | x | B | C | dt: 64 | 64 | 16 | 16 | 8
    for rank, part in enumerate(ranks):
        local = part["layers.0.op.in_proj.weight"]
        assert torch.equal(local[64:96], in_proj[128:160])  # B and C: the one group, whole
        assert torch.equal(local[:32], in_proj[rank * 32 : rank * 32 + 32])  # its half of z
