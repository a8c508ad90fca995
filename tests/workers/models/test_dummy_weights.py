"""`load_format="dummy"`: a model from its config.json alone, with vLLM's random weights (the
realistic-model benchmark's models); without it the missing weights are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.models.loader import WeightError
from hybridserve.workers.models.tiny import TINY_CONFIG

SMALL = {"max_model_len": 64, "block_size": 4, "num_kv_blocks": 32, "max_num_seqs": 2}


def test_a_config_alone_serves_with_random_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        with LLM(str(tmp_path), load_format="dummy", **SMALL) as llm:
            model = llm.engine.executor.driver.model
            weights = torch.cat([p.detach().flatten() for p in model.parameters()])
            assert weights.abs().max() <= 1e-3 and weights.std() > 1e-4
            (output,) = llm.generate([list(b"hello")], params, use_tqdm=False)
            assert len(output.token_ids) == 6
            runs.append((weights, output.token_ids))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]  # seeded


def test_without_dummy_a_checkpoint_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    with pytest.raises(WeightError, match="no weight files in the checkpoint"):
        LLM(str(tmp_path), **SMALL)
