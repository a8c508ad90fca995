"""One request's answer in the making (the ingress's side of a request): its choices' text,
token ids and logprobs, shaped as one OpenAI body or as stream chunks.

Completions' `echo` puts the prompt first (text, and with logprobs its tokens and their
logprobs, the first one None); a scoring request (echo with max_tokens 0) returns the prompt
alone, although the engine generated one token for it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from hybridserve.cluster.messages import GenerateRequest, TokenEvent
from hybridserve.cluster.openai.chat_output import ChatOutputParser, MessageDelta
from hybridserve.cluster.openai.choices import (
    ChoiceDelta,
    ChoiceStream,
    RequestStats,
    choice_deltas,
)
from hybridserve.cluster.openai.response_body import (
    LogprobsFormatter,
    ResponseMeta,
    Usage,
    choice,
    response_body,
    stream_chunk,
)
from hybridserve.workers.core.outputs import TokenLogprobs


class Reply:
    """One request's answer in the making: its choices' text, logprobs and token ids, as a
    whole body or as stream chunks (completions' echo puts the prompt first)."""

    def __init__(
        self,
        tokenizer: Any,
        body: Any,
        request: GenerateRequest,
        meta: ResponseMeta,
        parsers: Sequence[ChatOutputParser] = (),
    ) -> None:
        """`parsers`: one per choice of a chat request, reading its text as a message."""
        self.tokenizer = tokenizer
        # When the request arrived, before routing and admission: latencies count from here.
        self.arrived = time.monotonic()
        self.parsers = list(parsers)
        self.called = [False] * len(self.parsers)  # whether a choice has made tool calls
        self.body_request = body
        self.request = request
        self.meta = meta
        self.stats = RequestStats()
        self.echo = not meta.chat and body.echo
        self.formatter = LogprobsFormatter(tokenizer, as_token_ids=body.return_tokens_as_token_ids)
        self.streams = [
            ChoiceStream(
                i, tokenizer, body.stop or [], include_stop=body.include_stop_str_in_output
            )
            for i in range(body.n)
        ]
        self.texts: list[list[str]] = [[] for _ in self.streams]
        self.token_ids: list[list[int]] = [[] for _ in self.streams]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in self.streams]
        self.finish: list[str | None] = [None] * len(self.streams)
        self.text_offsets = [0] * len(self.streams)
        self.started = [False] * len(self.streams)
        self.num_sent = [0] * len(self.streams)  # tokens each choice's chunks have carried
        self.prompt_text = (
            tokenizer.decode(request.prompt_token_ids) if self.echo and tokenizer else ""
        )

    @property
    def include_usage(self) -> bool:
        return self.body_request.include_usage

    @property
    def wants_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def deltas(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[ChoiceDelta]:
        return choice_deltas(events, self.streams, self.stats, time.monotonic, self.arrived)

    # ---- non-streaming ---------------------------------------------------------------------

    def add(self, delta: ChoiceDelta) -> None:
        i = delta.index
        self.texts[i].append(delta.text)
        self.token_ids[i].extend(delta.token_ids)
        self.logprobs[i].extend(delta.logprobs or [])
        if delta.finish_reason is not None:
            self.finish[i] = delta.finish_reason

    def _finish_reason(
        self, index: int, reason: str | None, message: MessageDelta | None
    ) -> str | None:
        """OpenAI's "tool_calls" for a choice that ended on its own after calling tools
        (auto and required; a named function's call ends with "stop")."""
        if message is not None and message.tool_calls and self.parsers[index].calls_finish:
            self.called[index] = True
        if reason == "stop" and self.parsers and self.called[index]:
            return "tool_calls"
        return reason

    def usage(self) -> Usage:
        completion = 0 if self.body_request.scoring_only else self.stats.num_tokens
        return Usage(len(self.request.prompt_token_ids), completion, self.stats.num_cached_tokens)

    def body(self) -> dict[str, Any]:
        choices = []
        prompt_ids = self.request.prompt_token_ids
        for i in range(len(self.streams)):
            text, token_ids, logprobs = self._shown(
                "".join(self.texts[i]), self.token_ids[i], self.logprobs[i]
            )
            entries = self._logprobs(token_ids, logprobs, prompt=self.echo)
            message = None
            if self.parsers:
                message = self.parsers[i].feed(text).then(self.parsers[i].finish())
            choices.append(
                choice(
                    self.meta,
                    i,
                    self.prompt_text + text,
                    self._finish_reason(i, self.finish[i], message),
                    message=message,
                    logprobs=entries,
                    token_ids=token_ids if self.body_request.return_token_ids else None,
                    prompt_token_ids=prompt_ids if self.body_request.return_token_ids else None,
                )
            )
        body = response_body(
            self.meta,
            choices,
            self.usage(),
            prompt_token_ids=prompt_ids if self.body_request.return_token_ids else None,
        )
        self._add_prompt_logprobs(body)
        return body

    def _add_prompt_logprobs(self, body: dict[str, Any]) -> None:
        """vLLM's `prompt_logprobs` where a request asked for them: on the response for chat,
        on each choice for completions."""
        if self.body_request.prompt_logprobs is None:
            return
        entries = self.formatter.prompt(self.request.prompt_token_ids, self.stats.prompt_logprobs)
        if self.meta.chat:
            body["prompt_logprobs"] = entries
        else:
            for one in body["choices"]:
                one["prompt_logprobs"] = entries

    def _shown(
        self, text: str, token_ids: list[int], logprobs: list[TokenLogprobs]
    ) -> tuple[str, list[int], list[TokenLogprobs]]:
        """What a choice shows of its output: nothing for a scoring request (its one
        generated token only made the engine run the prompt)."""
        if self.body_request.scoring_only:
            return "", [], []
        return text, token_ids, logprobs

    def _logprobs(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        *,
        prompt: bool,
        text_offset: int = 0,
    ) -> dict[str, Any] | None:
        """The choice's `logprobs` field in the endpoint's shape (None when not asked for)."""
        if not self.wants_logprobs:
            return None
        if self.meta.chat:
            return self.formatter.chat(logprobs)
        return self._completion_logprobs(
            token_ids, logprobs, prompt=prompt, text_offset=text_offset
        )

    def _completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[TokenLogprobs],
        *,
        prompt: bool,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """Completions' logprobs of the output, after the prompt's with echo."""
        ids: list[int] = []
        entries: list[TokenLogprobs | None] = []
        if prompt:
            ids = list(self.request.prompt_token_ids)
            scored = self.stats.prompt_logprobs or [None] * len(ids)
            entries = list(scored)
        return self.formatter.completion(
            [*ids, *token_ids], [*entries, *logprobs], text_offset=text_offset
        )

    # ---- streaming -------------------------------------------------------------------------

    def chunk(self, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The chunk for one delta; tokens whose text is held back (an incomplete UTF-8
        sequence, a possible stop string) ride with the next chunk that has text. Tokens with
        no text to wait for (none held; a model without a tokenizer) go out at once."""
        i = delta.index
        self.token_ids[i].extend(delta.token_ids)
        self.logprobs[i].extend(delta.logprobs or [])
        first = not self.started[i]
        holding, visible, message = delta.holding, bool(delta.text), None
        if self.parsers:
            parser = self.parsers[i]
            message = parser.feed(delta.text)
            if delta.finish_reason is not None:
                message = message.then(parser.finish())
            holding, visible = holding or parser.holding, bool(message)
        ready = bool(self.token_ids[i]) and not holding
        if not (visible or delta.finish_reason is not None or first or ready):
            return None
        self.started[i] = True
        token_ids, self.token_ids[i] = self.token_ids[i], []
        logprobs, self.logprobs[i] = self.logprobs[i], []
        echo = self.echo and first
        text, token_ids, logprobs = self._shown(delta.text, token_ids, logprobs)
        self.num_sent[i] += len(token_ids)
        entries = self._logprobs(token_ids, logprobs, prompt=echo, text_offset=self.text_offsets[i])
        if entries is not None and not self.meta.chat:
            shown = [*(self.request.prompt_token_ids if echo else ()), *token_ids]
            self.text_offsets[i] += sum(len(self.formatter.text(t)) for t in shown)
        return_ids = self.body_request.return_token_ids
        chunk = stream_chunk(
            self.meta,
            choice(
                self.meta,
                i,
                (self.prompt_text if echo else "") + text,
                self._finish_reason(i, delta.finish_reason, message),
                message=message,
                stream=True,
                first=first,
                logprobs=entries,
                token_ids=token_ids if return_ids else None,
                prompt_token_ids=self.request.prompt_token_ids if return_ids and first else None,
            ),
            prompt_token_ids=self.request.prompt_token_ids
            if return_ids and first and self.meta.chat
            else None,
        )
        if first:
            self._add_prompt_logprobs(chunk)
        if self.body_request.continuous_usage:
            cached = self.stats.num_cached_tokens
            usage = Usage(len(self.request.prompt_token_ids), self.num_sent[i], cached)
            chunk["usage"] = usage.to_dict()
        return chunk


class BatchReply:
    """The answer to a /v1/completions request with several prompts, each run as a request
    of its own (`Reply`): prompt i's choice j is choice i * n + j, usage is the sum."""

    def __init__(self, meta: ResponseMeta, replies: list[Reply], n: int) -> None:
        self.meta = meta
        self.replies = replies
        self.n = n

    @property
    def include_usage(self) -> bool:
        return self.replies[0].include_usage

    def usage(self) -> Usage:
        parts = [reply.usage() for reply in self.replies]
        return Usage(
            sum(u.prompt_tokens for u in parts),
            sum(u.completion_tokens for u in parts),
            sum(u.cached_tokens for u in parts),
        )

    def _renumbered(self, prompt: int, part: dict[str, Any]) -> list[dict[str, Any]]:
        return [c | {"index": prompt * self.n + c["index"]} for c in part["choices"]]

    def chunk(self, prompt: int, chunk: dict[str, Any]) -> dict[str, Any]:
        return chunk | {"id": self.meta.id, "choices": self._renumbered(prompt, chunk)}

    def body(self, bodies: list[dict[str, Any]]) -> dict[str, Any]:
        choices = [c for i, part in enumerate(bodies) for c in self._renumbered(i, part)]
        return response_body(self.meta, choices, self.usage())
