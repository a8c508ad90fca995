"""Chat prompts carry their stable boundaries: the next turn resumes from the previous one, and
another conversation with the same system prompt from its end."""

from __future__ import annotations

import json

import pytest
import torch

from hybridserve.workers import LLM, SamplingParams
from hybridserve.workers.core.tokenizer import Tokenizer
from hybridserve.workers.models.tiny import SPECIAL_TOKENS, TINY_CONFIG, tiny_tokenizer_backend
from tests.helpers import assert_pools_at_baseline, make_hf_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello there"},
]
# The Qwen3.5 shape of chat: ChatML turns, the generation prompt opening a thinking block, and
# earlier assistant turns rendered without their reasoning (written for these tests).
QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.fixture(scope="module")
def qwen_chat_checkpoint(tmp_path_factory) -> str:
    """A Qwen3.5 (Gated DeltaNet) checkpoint with the tiny byte-level tokenizer and a
    Qwen-style template; its output rows favour printable ASCII, as tiny's do."""
    model = make_hf_model("qwen3_5", vocab_size=TINY_CONFIG["vocab_size"])
    with torch.no_grad():
        scale = torch.full((TINY_CONFIG["vocab_size"], 1), 0.1)
        scale[ord(" ") : ord("~") + 1] = 1.0
        model.lm_head.weight.mul_(scale)
    folder = tmp_path_factory.mktemp("qwen3_5_chat")
    model.save_pretrained(folder)
    tiny_tokenizer_backend().save(str(folder / "tokenizer.json"))
    config = {"eos_token": SPECIAL_TOKENS[2], "chat_template": QWEN_STYLE_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(params=["tiny", "qwen3_5"])
def chat_model(request) -> str:
    """The built-in (Mamba2) model, or the Qwen3.5 one."""
    return "tiny" if request.param == "tiny" else request.getfixturevalue("qwen_chat_checkpoint")


def test_a_qwen_style_template_keeps_its_boundaries_before_the_thinking_marker(
    qwen_chat_checkpoint,
):
    tokenizer = LLM(qwen_chat_checkpoint, enable_prefix_caching=False).tokenizer
    assert tokenizer is not None
    chat = tokenizer.render_chat(CONVERSATION)
    assert chat.system_len is not None and chat.stable_len is not None

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    assert text(chat.token_ids[: chat.system_len]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
    )
    assert text(chat.token_ids[chat.stable_len :]) == "<|im_start|>assistant\n<think>\n"


def test_render_chat_marks_the_system_prompt_and_the_conversation_without_the_generation_prompt():
    tokenizer = LLM("tiny", enable_prefix_caching=False).tokenizer
    assert tokenizer is not None
    chat = tokenizer.render_chat(CONVERSATION)
    system_len, stable_len = chat.system_len, chat.stable_len
    assert system_len is not None and stable_len is not None
    text = tokenizer.decode(chat.token_ids, skip_special_tokens=False)
    assert tokenizer.decode(chat.token_ids[:system_len], skip_special_tokens=False) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
    )
    assert text[
        len(tokenizer.decode(chat.token_ids[:stable_len], skip_special_tokens=False)) :
    ] == ("<|im_start|>assistant\n")
    # No system message, or nothing after it: only the conversation's own boundary.
    for messages in (CONVERSATION[1:], CONVERSATION[:1]):
        chat = tokenizer.render_chat(messages)
        assert chat.system_len is None and chat.stable_len is not None


def test_no_stable_boundary_when_it_is_not_a_prefix_or_the_template_refuses():
    reordering = Tokenizer(
        tiny_tokenizer_backend(),
        chat_template=(
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ),
    )
    chat = reordering.render_chat(CONVERSATION)
    assert chat.stable_len is None and chat.system_len is None
    refusing = Tokenizer(
        tiny_tokenizer_backend(),
        chat_template=(
            "{% if not add_generation_prompt %}{{ raise_exception('no') }}{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        ),
    )
    chat = refusing.render_chat(CONVERSATION)
    assert chat.stable_len is None and chat.system_len is None and chat.token_ids


@pytest.mark.parametrize("turn_end", [False, True], ids=["prompt-end", "turn-end"])
def test_second_turn_resumes_at_the_first_turn_end(chat_model, turn_end):
    llm = LLM(chat_model, snapshot_interval=0, snapshot_turn_end=turn_end)
    (first,) = llm.chat(CONVERSATION, GREEDY)
    assert first.num_cached_tokens == 0
    follow_up = [
        *CONVERSATION,
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "and again"},
    ]
    (second,) = llm.chat(follow_up, GREEDY)
    # The answer is ASCII, so the template renders it back to the same tokens. The turn-end
    # snapshot holds the state after all of them but the last sampled one (never fed back).
    assert first.text.isascii() and first.finish_reason == "length"
    resume = len(first.prompt_token_ids) + (len(first.token_ids) - 1 if turn_end else 0)
    # A Qwen-style template renders the answer without the "<think>\n" its generation prompt
    # opened: the next turn diverges there, and resumes from the first turn's stable boundary
    # (the conversation before the generation prompt), snapshotted for exactly this.
    continues = second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert continues == (chat_model == "tiny")
    if not continues:
        resume = llm.tokenizer.render_chat(CONVERSATION).stable_len  # type: ignore[union-attr]
    assert second.num_cached_tokens == resume
    plain = LLM(chat_model, enable_prefix_caching=False)
    assert second.token_ids == plain.chat(follow_up, GREEDY)[0].token_ids
    # The stable boundaries (the system prompt's end, the conversation without
    # "<|im_start|>assistant\n") were snapshotted too.
    chat = llm.tokenizer.render_chat(follow_up)  # type: ignore[union-attr]
    assert chat.stable_len is not None and chat.system_len is not None
    fields = {
        "num_prompt_tokens": len(second.prompt_token_ids),
        "stable_prompt_len": chat.stable_len,
        "system_prompt_len": chat.system_len,
    }
    points = llm.engine.cache.snapshot_points(type("R", (), fields)())
    assert {chat.system_len, chat.stable_len, len(second.prompt_token_ids)} <= set(points)


def test_another_conversation_resumes_at_the_end_of_the_shared_system_prompt(chat_model):
    llm = LLM(chat_model, snapshot_interval=0)
    llm.chat(CONVERSATION, GREEDY)
    other = [CONVERSATION[0], {"role": "user", "content": "something else entirely"}]
    (second,) = llm.chat(other, GREEDY)
    system_len = llm.tokenizer.render_chat(other).system_len  # type: ignore[union-attr]
    assert second.num_cached_tokens == system_len and system_len > 0
    plain = LLM(chat_model, enable_prefix_caching=False)
    assert second.token_ids == plain.chat(other, GREEDY)[0].token_ids
    assert_pools_at_baseline(llm.engine)
