"""Offline generation in one process (the vLLM `LLM` interface)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from hybridserve.workers.core.config import EngineConfig
from hybridserve.workers.core.engine import Engine
from hybridserve.workers.core.outputs import RequestOutput
from hybridserve.workers.core.sampling_params import SamplingParams
from hybridserve.workers.core.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """`LLM(model, **engine_args)`; with `tensor_parallel_size > 1` the engine spans that many
    processes until `shutdown()` (or the end of a `with` block, or of this process)."""

    def __init__(self, model: str = "tiny", **engine_args: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))

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
        request_ids = [
            self.engine.add_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)
        ]
        finished = self._run(request_ids, use_tqdm, "generating")
        return [finished[i] for i in request_ids]

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
                self.engine.add_request(
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
        with tqdm(total=len(request_ids), desc=what, unit="req", disable=not show) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if not output.finished:
                        continue
                    parent = output.parent_request_id or output.request_id
                    choices.setdefault(parent, []).append(output)
                    if output.parent_request_id is None:
                        finished[output.request_id] = output
                        bar.update(1)
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
