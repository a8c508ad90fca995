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

from hybridserve.cluster.openai_protocol import OpenAIError

OpenAIFinishReason = Literal["stop", "length"]  # the engine's "abort"/"error" become error events


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


def _build(
    meta: ResponseMeta,
    stream: bool,
    choice: dict[str, Any],
    token_ids: Sequence[int] | None,
    prompt_token_ids: Sequence[int] | None,
) -> dict[str, Any]:
    # NOTE: vLLM's return_token_ids layout: `token_ids` sits in the choice; `prompt_token_ids`
    # too for completions, but on the response itself for chat.
    body = meta._envelope(stream)
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        (body if meta.chat else choice)["prompt_token_ids"] = list(prompt_token_ids)
    body["choices"] = [choice]
    return body


def response_body(
    meta: ResponseMeta,
    text: str,
    finish_reason: OpenAIFinishReason,
    usage: Usage,
    *,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A non-streaming `text_completion` or `chat.completion` body (by `meta.chat`)."""
    if meta.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    body = _build(meta, False, choice, token_ids, prompt_token_ids)
    body["usage"] = usage.to_dict()
    return body


def stream_chunk(
    meta: ResponseMeta,
    text: str,
    finish_reason: OpenAIFinishReason | None = None,
    *,
    first: bool = False,
    token_ids: Sequence[int] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """One streamed delta; the first chat chunk carries `role`, the last one `finish_reason`.

    With return_token_ids, pass `token_ids` (this delta's) on every chunk and `prompt_token_ids`
    on the first.
    """
    if meta.chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    return _build(meta, True, choice, token_ids, prompt_token_ids)


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
