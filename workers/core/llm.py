"""Offline generation in one process (the vLLM `LLM` interface)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.detokenizer import Detokenizer
from hybridserve.workers.core.engine import Engine
from hybridserve.workers.core.outputs import RequestOutput
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.stop_strings import StopStringMatcher
from hybridserve.workers.core.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """`LLM(model, **engine_args)`; with `tensor_parallel_size > 1` the engine spans that many
    processes until `shutdown()` (or the end of a `with` block, or of this process)."""

    def __init__(self, model: str = "tiny", **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._stops: dict[str, SamplingParams] = {}  # request id -> params with stop strings

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in prompt order."""
        prompt_list = _as_prompt_list(prompts)
        params_list = (
            list(sampling_params)
            if isinstance(sampling_params, Sequence)
            else [sampling_params or SamplingParams()] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        request_ids = [self._add(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        finished = self._run(request_ids, use_tqdm, "generating")
        return [finished[i] for i in request_ids]

    def _add(self, prompt: Any, params: SamplingParams, **options: Any) -> str:
        """Queue a request; its stop strings are matched here, as its tokens come."""
        request_id = self.engine.add_request(
            prompt, params.model_copy(update={"stop": ()}), **options
        )
        if params.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; use stop_token_ids")
            self._stops[request_id] = params
        return request_id

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's next message for each conversation (list of messages).

        Each prompt carries its stable boundaries (its system messages alone, the
        conversation without the generation prompt), so snapshots land where other
        conversations with the same system prompt, and the next turn, will diverge."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this checkpoint has no tokenizer.json")
        batch = (
            [conversations]
            if conversations and isinstance(conversations[0], dict)
            else list(conversations)
        )
        params = sampling_params or SamplingParams()
        request_ids = []
        for messages in batch:
            chat = self.tokenizer.render_chat(messages)  # type: ignore[arg-type]
            request_ids.append(
                self._add(
                    chat.token_ids,
                    params,
                    cache_salt=cache_salt,
                    stable_prompt_len=chat.stable_len,
                    system_prompt_len=chat.system_len,
                )
            )
        finished = self._run(request_ids, use_tqdm, "chatting")
        return [finished[i] for i in request_ids]

    def _run(
        self, request_ids: list[str], use_tqdm: bool | None, what: str
    ) -> dict[str, RequestOutput]:
        """Step until every request (every choice of each) finished; request id -> output,
        with an n > 1 request's choices in `choices` (itself first)."""
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        finished: dict[str, RequestOutput] = {}
        choices: dict[str, list[RequestOutput]] = {}
        watches: dict[str, StopWatch] = {}
        with tqdm(total=len(request_ids), desc=what, unit="req", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    parent = output.parent_request_id or output.request_id
                    params = self._stops.get(parent)
                    if params is not None:
                        watch = watches.setdefault(
                            output.request_id, StopWatch(self.tokenizer, params)
                        )
                        if watch.feed(output) and not output.finished:
                            self.engine.stop(output.request_id)  # its output comes next step
                    if not output.finished:
                        continue
                    choices.setdefault(parent, []).append(output)
                    if output.parent_request_id is None:
                        finished[output.request_id] = output
                        bar.update(1)
        for request_id in request_ids:
            self._stops.pop(request_id, None)
        if self.engine.dead is not None:
            raise RuntimeError(f"generation failed: {self.engine.dead}")
        for request_id, output in finished.items():
            if len(choices[request_id]) > 1:
                output.choices = sorted(choices[request_id], key=lambda o: o.index)
        return finished


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return items


class StopWatch:
    """One choice's text as its tokens come, cut at its first stop string; once it ends, the
    output's text is the cut text and its stop_reason the string."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.matcher = StopStringMatcher(params.stop)
        self.include = params.include_stop_str_in_output
        self.text = ""
        self.stop: str | None = None
        self.num_tokens = 0

    def feed(self, output: RequestOutput) -> bool:
        """Whether the choice hit a stop string (now or before)."""
        if self.stop is None:
            new = output.token_ids[self.num_tokens :]
            self.num_tokens = len(output.token_ids)
            match = self.matcher.feed(self.detokenizer.feed(new, output.finished))
            self.text += match.text
            if match.stopped:
                self.stop = match.stop
                self.text += (self.stop or "") if self.include else ""
            elif output.finished:
                self.text += self.matcher.flush()
        if output.finished:
            output.text = self.text
            if self.stop is not None:
                output.finish_reason, output.stop_reason = "stop", self.stop
        return self.stop is not None
