"""Tokenizer: the tiny byte-level tokenizer, special tokens, chat templates, loading from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridserve.workers.core.tokenizer import ChatTemplateError, Tokenizer
from hybridserve.workers.models.tiny import (
    CHAT_TEMPLATE,
    tiny_tokenizer,
    tiny_tokenizer_backend,
    write_tiny_checkpoint,
)

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]
TEXTS = ["Hello, world!", "  two  spaces\tand\ttabs\n", "héllo wörld", "日本語 🙂", ""]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return tiny_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_token_ids_are_the_utf8_bytes_and_decode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_vocabulary_is_256_bytes_plus_three_special_tokens(tokenizer):
    assert tokenizer.vocab_size == 259
    assert tokenizer.token_id("<|endoftext|>") == 256
    assert tokenizer.token_id("<|im_start|>") == 257
    assert tokenizer.token_id("<|im_end|>") == 258
    assert tokenizer.token_id("<|nope|>") is None


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("<|endoftext|>", [256]),
        ("<|im_start|>", [257]),
        ("<|im_end|>", [258]),
        ("<|im_start|>hi<|im_end|>", [257, 104, 105, 258]),
        ("a<|endoftext|>b", [97, 256, 98]),
    ],
)
def test_special_tokens_encode_to_single_ids(tokenizer, text, ids):
    assert tokenizer.encode(text) == ids


def test_decode_skips_special_tokens_unless_asked(tokenizer):
    ids = [257, 104, 105, 258, 256]
    assert tokenizer.decode(ids) == "hi"
    with_specials = tokenizer.decode(ids, skip_special_tokens=False)
    assert with_specials == "<|im_start|>hi<|im_end|><|endoftext|>"


def test_a_partial_utf8_sequence_decodes_without_raising(tokenizer):
    ids = list("é".encode())  # two bytes
    assert tokenizer.decode(ids[:1]) == "\ufffd"


def test_chat_template_renders_chatml_with_a_generation_prompt(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_renders_chatml_without_a_generation_prompt(tokenizer):
    assert tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_a_rendered_conversation_tokenizes_with_special_ids(tokenizer):
    ids = tokenizer.encode(tokenizer.apply_chat_template(CONVERSATION[1:]))
    assert ids == [257, *b"user\nHi", 258, 10, 257, *b"assistant\n"]


def test_raise_exception_in_a_template_becomes_a_chat_template_error():
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation must start with a user message') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    tokenizer = Tokenizer(tiny_tokenizer_backend(), chat_template=template)
    assert tokenizer.apply_chat_template(CONVERSATION[1:]) == "Hi"
    with pytest.raises(ChatTemplateError, match=r"^Conversation must start with a user message$"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_a_template_that_fails_while_rendering_is_a_chat_template_error():
    tokenizer = Tokenizer(tiny_tokenizer_backend(), chat_template="{{ messages[0]['x'].y() }}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_a_template_with_a_syntax_error_is_a_chat_template_error():
    tokenizer = Tokenizer(tiny_tokenizer_backend(), chat_template="{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_the_template_sandbox_blocks_unsafe_attribute_access():
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer(tiny_tokenizer_backend(), chat_template=template)
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template(CONVERSATION)


def test_template_helpers_tojson_and_special_tokens():
    template = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{{ extra }}"
    tokenizer = Tokenizer(
        tiny_tokenizer_backend(), chat_template=template, bos_token="<s>", eos_token="</s>"
    )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é"}], extra="!")
    assert rendered == '<s>[{"role": "user", "content": "é"}]</s>!'


def test_no_template_is_a_chat_template_error():
    tokenizer = Tokenizer(tiny_tokenizer_backend())
    with pytest.raises(ChatTemplateError, match="this model has no chat template"):
        tokenizer.apply_chat_template(CONVERSATION)


def test_chat_template_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)


# ---- loading from a checkpoint folder -----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_from_pretrained_equals_the_in_memory_tokenizer(tiny_folder, tokenizer):
    loaded = Tokenizer.from_pretrained(tiny_folder)
    assert loaded.vocab_size == tokenizer.vocab_size
    assert loaded.chat_template == tokenizer.chat_template == CHAT_TEMPLATE
    assert (loaded.bos_token, loaded.eos_token, loaded.add_bos_token) == (
        None,
        "<|endoftext|>",
        False,
    )
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        assert loaded.encode(text) == tokenizer.encode(text)
    ids = [257, *range(0, 256, 7), 258]
    assert loaded.decode(ids) == tokenizer.decode(ids)
    assert loaded.apply_chat_template(CONVERSATION) == tokenizer.apply_chat_template(CONVERSATION)


def write_tokenizer_folder(folder: Path, config: dict | None, template_file: str | None = None):
    folder.mkdir()
    tiny_tokenizer_backend().save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (folder / "chat_template.jinja").write_text(template_file)
    return folder


def test_from_pretrained_without_a_tokenizer_json_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_from_pretrained_without_a_config_has_no_template(tmp_path):
    loaded = Tokenizer.from_pretrained(write_tokenizer_folder(tmp_path / "t", None))
    assert loaded.chat_template is None and loaded.eos_token is None
    assert loaded.encode("hi") == [104, 105]


def test_from_pretrained_reads_chat_template_jinja(tmp_path):
    folder = write_tokenizer_folder(tmp_path / "t", {}, template_file="{{ 'from file' }}")
    assert Tokenizer.from_pretrained(folder).apply_chat_template(CONVERSATION) == "from file"


def test_from_pretrained_picks_the_default_of_named_templates(tmp_path):
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "{{ 'tools' }}"},
            {"name": "default", "template": "{{ 'default' }}"},
        ]
    }
    folder = write_tokenizer_folder(tmp_path / "t", config)
    assert Tokenizer.from_pretrained(folder).apply_chat_template(CONVERSATION) == "default"


def test_from_pretrained_adds_bos_once_when_configured(tmp_path):
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
    }
    loaded = Tokenizer.from_pretrained(write_tokenizer_folder(tmp_path / "t", config))
    assert (loaded.bos_token, loaded.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert loaded.encode("hi") == [257, 104, 105]
    assert loaded.encode("<|im_start|>hi") == [257, 104, 105]  # not doubled
    assert loaded.encode("hi", add_special_tokens=False) == [104, 105]
    assert loaded.encode("") == [257]
