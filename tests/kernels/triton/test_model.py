"""The `tiny` model on the Triton backend (interpreter on the CPU) against the reference path."""

from __future__ import annotations

import logging

import pytest

from hybridserve.kernels import dispatch
from hybridserve.kernels.dispatch import BACKEND_ENV
from hybridserve.workers import LLM, SamplingParams
from tests.helpers import random_prompts

pytestmark = pytest.mark.triton


def greedy_tokens(monkeypatch: pytest.MonkeyPatch, backend: str) -> list[list[int]]:
    monkeypatch.setenv(BACKEND_ENV, backend)
    # A budget of 16 splits the 21-token prompt into chunks, so prefill runs over a cached
    # prefix, and two prompts make the chunk scan and the attention see packed sequences.
    llm = LLM("tiny", max_num_batched_tokens=16, block_size=8, enable_prefix_caching=False)
    prompts = random_prompts([21, 6], seed=3, vocab=200)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    return [out.token_ids for out in outputs]


def test_tiny_model_greedy_tokens_equal_the_reference(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        triton_tokens = greedy_tokens(monkeypatch, "triton")
    assert "kernel backend: triton" in caplog.text
    assert triton_tokens == greedy_tokens(monkeypatch, "reference")
