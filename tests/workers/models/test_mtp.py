"""Multi-token-prediction layers: loaded from `mtp.*` tensors and run by the engine's model,
against a plain-torch reference of the published architecture written here.

The reference composes the step from its parts, as the model cards and peers describe it:
the embedding of the next token and the target's hidden state, each RMS-normed, concatenated
(embedding first) and projected back to the hidden size; the decoder layers of the step
(transformers' own layer classes of the family: the full-attention decoder layer of Qwen3.5
and of Qwen3-Next, NemotronH's attention and MoE blocks), causal over the step's positions; a
final RMSNorm; the target's LM head. The test checkpoints get random MTP tensors under the
names the families' checkpoints use."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hybridserve.workers import LLM, Engine, EngineConfig, SamplingParams
from hybridserve.workers.core.step_plan import ScheduledChunk
from hybridserve.workers.executors.parallel import ParallelContext
from hybridserve.workers.models.loader import open_checkpoint, read_model_config
from hybridserve.workers.runner import mtp_drafts as mtp_drafts_module
from hybridserve.workers.runner.model_runner import ModelRunner
from tests.helpers import assert_pools_at_baseline, make_hf_model, random_prompts
from tests.mtp import MTP_SPECULATION, QWEN, add_mtp_layers

BLOCK = 8


@torch.no_grad()
def reference_logits(
    arch: str, hf_model: Any, parts: dict[str, Any], next_tokens: list[int], hidden: torch.Tensor
) -> torch.Tensor:
    """One MTP step over positions 0..T-1: (T, vocab) logits."""
    return reference_step(arch, hf_model, parts, next_tokens, hidden)[0]


@torch.no_grad()
def reference_step(
    arch: str, hf_model: Any, parts: dict[str, Any], next_tokens: list[int], hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP step over positions 0..T-1: (T, vocab) logits and the (T, hidden) outputs."""
    count = len(next_tokens)
    embeds = hf_model.get_input_embeddings()(torch.tensor([next_tokens]))
    out = parts["fc"](torch.cat([parts["enorm"](embeds), parts["hnorm"](hidden[None])], dim=-1))
    positions = torch.arange(count)[None]
    mask = torch.full((count, count), float("-inf")).triu(1)[None, None]
    for layer in parts["layers"]:
        if arch in QWEN:
            rotary = hf_model.model.rotary_emb(out, positions)
            out = layer(
                out, position_embeddings=rotary, attention_mask=mask, position_ids=positions
            )
        else:
            out = layer(out, attention_mask=mask, position_ids=positions)
    out = parts["final"](out)[0]
    return hf_model.lm_head(out).float(), out


@pytest.fixture(scope="module", params=[*QWEN, "nemotron_h"])
def mtp_checkpoint(request, tmp_path_factory) -> tuple[str, Path, Any, dict[str, Any]]:
    folder = tmp_path_factory.mktemp(f"{request.param}-mtp")
    hf_model = make_hf_model(request.param)
    hf_model.save_pretrained(folder)
    parts = add_mtp_layers(request.param, hf_model, folder)
    return request.param, folder, hf_model, parts


def test_the_config_declares_the_mtp_layers(mtp_checkpoint):
    arch, folder, _, _ = mtp_checkpoint
    config = read_model_config(str(folder))
    assert config.num_mtp_steps == 1
    expected = ("attention", "mlp") if arch == "qwen3_5" else ("attention", "moe")
    assert config.mtp_layer_kinds == expected


@torch.no_grad()
def test_an_mtp_step_equals_the_reference_and_continues_from_its_kv(mtp_checkpoint):
    """A prompt-like run over 11 positions, then one position more that attends over the KV
    the first wrote: both equal the reference over the whole sequence."""
    arch, folder, hf_model, parts = mtp_checkpoint
    config = EngineConfig(
        model=str(folder),
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        max_model_len=64,
        block_size=BLOCK,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )
    runner = ModelRunner(config, open_checkpoint(str(folder)), ParallelContext())
    runner.allocate_pools(runner.pool_sizes(64))
    assert runner.caches.kv is not None
    assert runner.caches.kv.shape[1] == runner.model_config.num_attention_layers + 1
    model = runner.model
    assert model.mtp is not None
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (12,), generator=generator).tolist()
    hidden = torch.randn(12, model.config.hidden_size, generator=generator)
    expected = reference_logits(arch, hf_model, parts, tokens, hidden)
    table = list(range(math.ceil(12 / BLOCK)))
    got = []
    for start, end in ((0, 11), (11, 12)):
        chunk = ScheduledChunk("r", tokens[start:end], start, table, 0)
        batch, _ = runner.build_batch([chunk], runner.device)
        embeds = model.embed(batch.input_ids)
        out = model.mtp(0, embeds, hidden[start:end], batch, runner.caches)
        got.append(model.compute_logits(out))
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


ENGINE = {
    "max_model_len": 160,
    "block_size": BLOCK,
    "max_num_seqs": 4,
    "enable_prefix_caching": False,
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MTP = MTP_SPECULATION


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_greedy_tokens_with_mtp_drafts_equal_the_plain_engine_s(mtp_checkpoint, batched):
    """Random MTP layers guess badly: nearly every step rolls back, and the tokens stay."""
    _, folder, _, _ = mtp_checkpoint
    prompts = random_prompts([23, 41, 9], seed=3)
    with LLM(str(folder), **ENGINE) as plain:
        reference = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    groups = [prompts] if batched else [[p] for p in prompts]
    with LLM(str(folder), speculative_config=MTP, **ENGINE) as llm:
        outputs = [o for group in groups for o in llm.generate(group, GREEDY, use_tqdm=False)]
        assert [o.token_ids for o in outputs] == reference
        assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0
        assert_pools_at_baseline(llm.engine)


def test_greedy_tokens_with_mtp_drafts_at_tp2_equal_tp1_without(mtp_checkpoint):
    """Every rank runs its shard of the MTP layers on the tokens rank 0 sampled and guessed."""
    _, folder, _, _ = mtp_checkpoint
    prompts = random_prompts([23, 9], seed=4)
    with LLM(str(folder), **ENGINE) as plain:
        reference = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(str(folder), speculative_config=MTP, tensor_parallel_size=2, **ENGINE) as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, False)] == reference
        assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0
        llm.engine.check_integrity()


def test_mtp_speculation_needs_a_checkpoint_with_mtp_layers(tmp_path):
    make_hf_model("qwen3_5").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs the checkpoint's multi-token-prediction layers"):
        LLM(str(tmp_path), speculative_config=MTP, **ENGINE)


@torch.no_grad()
def test_the_first_drafts_are_the_reference_s_chained_guesses(mtp_checkpoint, monkeypatch):
    """After the prompt's step, the drafts are the MTP chain over the target's hidden states
    (transformers' final-normed ones): the first from the prompt's positions with the
    sampled token after the last, each next one from the previous step's output and guess
    at the next position. Each guess's logits are compared, not only its argmax."""
    arch, folder, hf_model, parts = mtp_checkpoint
    prompt = random_prompts([17], seed=8)[0]
    engine = Engine(EngineConfig(model=str(folder), speculative_config=MTP, **ENGINE))
    seen: list[torch.Tensor] = []
    argmax = mtp_drafts_module._argmax

    def recording(runner, hidden):
        seen.append(runner.model.compute_logits(hidden))
        return argmax(runner, hidden)

    monkeypatch.setattr(mtp_drafts_module, "_argmax", recording)
    request_id = engine.add_request(prompt, GREEDY)
    (first,) = engine.step()
    drafts = engine.requests[request_id].speculation.pending
    target = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
    tokens, hidden = [*prompt[1:], first.token_ids[0]], target
    expected = []
    for step in range(MTP["num_speculative_tokens"]):
        logits, out = reference_step(arch, hf_model, parts, tokens, hidden)
        torch.testing.assert_close(seen[step][-1], logits[-1], atol=1e-4, rtol=1e-4)
        guess = int(logits[-1].argmax())
        expected.append(guess)
        tokens, hidden = [*tokens, guess], torch.cat([hidden, out[-1:]])
    assert drafts == expected
    engine.abort(request_id)
    assert_pools_at_baseline(engine)
