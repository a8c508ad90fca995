"""Tokenizer (HF `tokenizer.json` through `tokenizers`) and chat template (jinja2)."""

from __future__ import annotations

import bisect
import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import jinja2.sandbox
from tokenizers import Tokenizer as BackendTokenizer


@dataclass(frozen=True)
class ChatPrompt:
    token_ids: list[int]
    # Tokens of the conversation rendered without the generation prompt, when those are a true
    # prefix of `token_ids`: where the next turn's prompt will diverge from this one.
    stable_len: int | None = None
    # Tokens of the leading system (or developer) messages rendered alone, when a true prefix:
    # where other conversations with the same system prompt diverge from this one.
    system_len: int | None = None
    # The rendered prompt (chat only): the output parsers read how it ends (an open `<think>`).
    text: str | None = None


# Roles of the messages that open a conversation and that many conversations share.
SYSTEM_ROLES = frozenset({"system", "developer"})


class ChatTemplateError(ValueError):
    """The chat template rejected the conversation, or no template exists."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _token_text(value: Any) -> str | None:
    """`tokenizer_config.json` stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# Per-request templates (`chat_template` in a request) are compiled once each, up to this many.
MAX_CACHED_TEMPLATES = 8


def _strftime_now(format: str) -> str:
    """The current local time, as HF's template environment gives it (Granite templates
    print today's date into the system prompt)."""
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """One compiled chat template, in HF's sandboxed environment, and the variables it reads
    (so that a request's `chat_template_kwargs` naming a variable no template reads is refused
    rather than ignored)."""

    def __init__(self, source: str) -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def reads(self, name: str) -> bool:
        return name in self.variables

    def render(self, messages: list[dict[str, Any]], **variables: Any) -> str:
        try:
            return self._template.render(messages=messages, **variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


class Tokenizer:
    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token and bos_token is not None
        self._templates: dict[str, ChatTemplate] = {}

    @classmethod
    def from_pretrained(cls, folder: Path) -> Tokenizer:
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json (an HF-format checkpoint needs "
                "one; pass token ids instead of text to run without it)"
            )
        backend = BackendTokenizer.from_file(str(file))
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        template = config.get("chat_template")
        template_file = folder / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            backend,
            chat_template=template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token:
            bos_id = self.token_id(self.bos_token or "")
            if bos_id is not None and (not ids or ids[0] != bos_id):
                ids = [bos_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def template(self, source: str | None = None) -> ChatTemplate:
        """The compiled chat template: `source` (a per-request or configured override) or the
        checkpoint's own."""
        source = self.chat_template if source is None else source
        if source is None:
            raise ChatTemplateError(
                "this model has no chat template (tokenizer_config.json has "
                "no chat_template); send a plain completion instead"
            )
        compiled = self._templates.get(source)
        if compiled is None:
            compiled = ChatTemplate(source)
            if len(self._templates) >= MAX_CACHED_TEMPLATES:
                self._templates.pop(next(iter(self._templates)))
            self._templates[source] = compiled
        return compiled

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str:
        return self.template(chat_template).render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> ChatPrompt:
        """Token ids of a chat prompt (with the generation prompt) and its stable prefixes: the
        conversation without the generation prompt, and its leading system messages alone.

        Both are best effort (docs/snapshot-reuse.md section 3): a part the template rejects,
        renders as something that is not a prefix of the prompt's text, or that ends inside
        one of its tokens, is None. The prompt is encoded once; a part's length is the number
        of its tokens that end within the part's text.
        """
        text = self.apply_chat_template(messages, **extra)
        encoding = self.backend.encode(text, add_special_tokens=False)
        token_ids, ends = encoding.ids, [end for _, end in encoding.offsets]

        def prefix_len(part: list[dict[str, Any]]) -> int | None:
            try:
                part_text = self.apply_chat_template(part, add_generation_prompt=False, **extra)
            except ChatTemplateError:
                return None
            num_tokens = bisect.bisect_right(ends, len(part_text))
            is_prefix = (
                text.startswith(part_text)
                and 0 < num_tokens < len(token_ids)
                and ends[num_tokens - 1] == len(part_text)
            )
            return num_tokens if is_prefix else None

        num_system = next(
            (i for i, m in enumerate(messages) if m.get("role") not in SYSTEM_ROLES), len(messages)
        )
        system_len = prefix_len(messages[:num_system]) if 0 < num_system < len(messages) else None
        return ChatPrompt(token_ids, prefix_len(messages), system_len, text)
