"""One request's state: token ids plus cursors. There are no prefill/decode phases.

    token_ids: | prompt ........................ | output ...... |
                0                  num_computed_tokens         num_tokens
                [computed: KV + Mamba state exist)[to compute)

Each step the scheduler gives a request some of [num_computed_tokens, num_tokens); when a step
brings num_computed_tokens to num_tokens, the model's last logits sample one more token.
Prefill, chunked prefill, decode and recompute after preemption are all this one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from hybridserve.workers.outputs import FinishReason, RequestOutput
from hybridserve.workers.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Disaggregation: a prefill engine's request after its first token, holding its blocks and
    # slot for the transfer; a decode engine's request whose state is still arriving.
    HANDED_OFF = "handed_off"
    RECEIVING = "receiving"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Token ids that end the request (EOS unless ignore_eos, plus stop_token_ids).
    stop_token_ids: frozenset[int]
    # Sampling randomness seed; see `Sampler` for how it combines with the position.
    sample_seed: int
    # Reuse scope: requests with different salts (tenants) never share cached blocks.
    cache_salt: str | None = None
    # Prompt scoring: the logits of every prompt token come back, so none may be reused.
    keep_logits: bool = False
    # For chat requests: tokens of the conversation rendered without the generation prompt,
    # when those are a true prefix of the prompt (where the next turn will diverge).
    stable_prompt_len: int | None = None
    # Set by the cache manager before every scheduling pass: chunks must end at these
    # absolute positions. None = not set (an error under FORCE_CHUNK), [] = none wanted.
    expect_snapshot_points: list[int] | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None  # why, when finish_reason is "error"

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=self.output_token_ids,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )
