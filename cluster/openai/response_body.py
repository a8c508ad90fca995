"""The OpenAI-compatible responses: JSON bodies, stream chunks, the model list and SSE framing.

Responses are plain dicts in OpenAI's shape plus vLLM's extension names (`token_ids`,
`prompt_token_ids`); one `ResponseMeta` per request gives every body and chunk the same id,
model and timestamp. No FastAPI or Ray import: the app adapts these to HTTP.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from hybridserve.cluster.openai.chat_output import MessageDelta
from hybridserve.cluster.openai.protocol import OpenAIError
from hybridserve.workers.core.outputs import TokenLogprobs

# The engine's "abort" and "error" become error events.
OpenAIFinishReason = Literal["stop", "length", "tool_calls"]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """What every body or chunk of one response shares; make one per request with `new`."""

    id: str
    model: str
    created: int
    chat: bool

    @classmethod
    def new(cls, model: str, *, chat: bool) -> ResponseMeta:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()), chat)

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _envelope(meta: ResponseMeta, stream: bool, prompt_token_ids: Sequence[int] | None) -> dict:
    # NOTE: vLLM's return_token_ids layout: `prompt_token_ids` on the response for chat, in
    # the choice for completions (see `choice`).
    body = meta._envelope(stream)
    if prompt_token_ids is not None and meta.chat:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def choice(
    meta: ResponseMeta,
    index: int,
    text: str,
    finish_reason: OpenAIFinishReason | None,
    *,
    stream: bool = False,
    first: bool = False,
    logprobs: dict[str, Any] | None = None,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    message: MessageDelta | None = None,
) -> dict[str, Any]:
    """One choice of a body (`stream` False) or of a chunk; the first chat chunk of a choice
    carries `role`. A chat choice's `message` (its text read by the output parsers) gives its
    reasoning and tool calls; without one, `text` is its content. With return_token_ids:
    `token_ids` (this choice's, or this delta's) and, for completions, `prompt_token_ids`."""
    if meta.chat:
        parts = message if message is not None else MessageDelta(content=text)
        fields = _message_fields(parts, stream=stream, first=first)
        if stream:
            body: dict[str, Any] = {"index": index, "delta": fields}
        else:
            body = {"index": index, "message": fields}
    else:
        body = {"index": index, "text": text}
    body |= {"logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        body["token_ids"] = list(token_ids)
    if prompt_token_ids is not None and not meta.chat:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def _message_fields(parts: MessageDelta, *, stream: bool, first: bool) -> dict[str, Any]:
    """An assistant message, or a stream delta of one (OpenAI's shape, with vLLM's
    `reasoning_content`): content is null beside tool calls with no text."""
    fields: dict[str, Any] = {"role": "assistant"} if first or not stream else {}
    if parts.content or not (parts.reasoning or parts.tool_calls):
        fields["content"] = parts.content
    elif not stream:
        fields["content"] = None
    if parts.reasoning:
        fields["reasoning_content"] = parts.reasoning
    if parts.tool_calls:
        if stream:
            offset = parts.first_call_index
            fields["tool_calls"] = [c.to_openai(offset + i) for i, c in enumerate(parts.tool_calls)]
        else:
            fields["tool_calls"] = [c.to_openai() for c in parts.tool_calls]
    return fields


def response_body(
    meta: ResponseMeta,
    choices: list[dict[str, Any]],
    usage: Usage,
    *,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A non-streaming `text_completion` or `chat.completion` body (by `meta.chat`)."""
    body = _envelope(meta, False, prompt_token_ids)
    body["choices"] = sorted(choices, key=lambda c: c["index"])
    body["usage"] = usage.to_dict()
    return body


def stream_chunk(
    meta: ResponseMeta, one_choice: dict[str, Any], prompt_token_ids: Sequence[int] | None = None
) -> dict[str, Any]:
    """One streamed delta of one choice (made with `choice(..., stream=True)`)."""
    return _envelope(meta, True, prompt_token_ids) | {"choices": [one_choice]}


class LogprobsFormatter:
    """Token logprobs in OpenAI's two shapes: completions' parallel lists and chat's
    `content` entries. Tokens are shown as their text, or as "token_id:<id>" with vLLM's
    return_tokens_as_token_ids."""

    def __init__(self, tokenizer: Any, *, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids

    def text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        if self.as_token_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.text(token_id)

    def completion(
        self,
        token_ids: Sequence[int],
        entries: Sequence[TokenLogprobs | None],
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """`{tokens, token_logprobs, top_logprobs, text_offset}`; an entry of None (the
        first prompt token, which nothing predicts) has no logprob and no top list."""
        offsets = []
        for token_id in token_ids:  # offsets into the text, whichever form tokens are shown in
            offsets.append(text_offset)
            text_offset += len(self.text(token_id))
        return {
            "tokens": [self.token(t) for t in token_ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [
                None if e is None else {self.token(t): lp for t, lp in e.top} for e in entries
            ],
            "text_offset": offsets,
        }

    def prompt(
        self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None] | None
    ) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id (as
        text) -> {logprob, rank, decoded_token} for the token there and the top ones. A rank
        is known where the token is among the top ones."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for position, entry in enumerate(entries or [None] * len(token_ids)):
            if entry is None:
                out.append(None)
                continue
            ranked = {token: rank for rank, (token, _) in enumerate(entry.top, start=1)}
            pairs = [(token_ids[position], entry.logprob), *entry.top]
            out.append(
                {
                    str(token): {
                        "logprob": logprob,
                        "rank": ranked.get(token),
                        "decoded_token": self.token(token),
                    }
                    for token, logprob in pairs
                }
            )
        return out

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """`{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`."""

        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }


def usage_chunk(meta: ResponseMeta, usage: Usage) -> dict[str, Any]:
    """The `stream_options.include_usage` chunk, sent after the finish chunk, before [DONE]."""
    return meta._envelope(True) | {"choices": [], "usage": usage.to_dict()}


def models_list(model_ids: Sequence[str], created: int | None = None) -> dict[str, Any]:
    """GET /v1/models."""
    created = int(time.time()) if created is None else created
    return {
        "object": "list",
        "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "hybridserve"}
            for model_id in model_ids
        ],
    }


# Server-sent events: `data: <json>\n\n` per chunk, then `data: [DONE]\n\n`. A stream that fails
# midway ends with one error event and no [DONE], so clients cannot mistake it for a success.
SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_error(error: OpenAIError) -> str:
    return sse_event(error.body())
