"""`dtype: auto`: the checkpoint's torch_dtype on CUDA, float32 on the CPU (logged once when
that is not the checkpoint's); an explicit dtype is never changed."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hybridserve.workers import LLM
from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.runner import precision
from hybridserve.workers.runner.precision import resolve_precision
from tests.helpers import make_hf_model


@pytest.mark.parametrize(
    ("raw", "device", "expected"),
    [
        ({"torch_dtype": "bfloat16"}, "cuda", "bfloat16"),
        ({"dtype": "float16"}, "cuda", "float16"),  # newer transformers write `dtype`
        ({"torch_dtype": "float32"}, "cuda", "float32"),
        ({"text_config": {"torch_dtype": "bfloat16"}}, "cuda", "bfloat16"),  # image-text
        ({}, "cuda", "bfloat16"),
        ({"torch_dtype": "bfloat16"}, "cpu", "float32"),
        ({"torch_dtype": "float16"}, "cpu", "float32"),
        ({}, "cpu", "float32"),
    ],
)
def test_auto_follows_the_checkpoint_on_cuda_and_is_float32_on_the_cpu(raw, device, expected):
    assert resolve_precision(EngineConfig(device=device), raw).dtype == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_kept(dtype):
    for device in ("cpu", "cuda"):
        config = EngineConfig(device=device, dtype=dtype)
        assert resolve_precision(config, {"torch_dtype": "float16"}).dtype == dtype


def test_a_bfloat16_checkpoint_runs_float32_on_the_cpu_said_once(tmp_path, caplog):
    make_hf_model("qwen3_5").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"torch_dtype": "bfloat16"}))
    precision._logged.clear()
    with caplog.at_level(logging.INFO, logger=precision.__name__):
        llm = LLM(str(tmp_path), device="cpu")
        resolve_precision(EngineConfig(device="cpu"), {"torch_dtype": "bfloat16"})
    assert llm.engine.config.dtype == "float32"
    assert llm.engine.layout.kv_dtype == "torch.float32"
    assert llm.engine.executor.driver.model.final_norm.weight.dtype == torch.float32
    assert caplog.text.count("dtype auto: the checkpoint is bfloat16") == 1
