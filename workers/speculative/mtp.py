"""The MTP proposer: the drafts the checkpoint's multi-token-prediction layers guessed at the
end of the request's last step (runner/mtp_drafts.py), handed to the scheduler.

The layers run inside the runner because they need the target's hidden states; the engine
stores each request's guesses on it (`RequestSpeculation.pending`) after the step, and this
proposer gives them out when the scheduler asks. A request without guesses (its first
decode step after a hand-off, say) verifies nothing that step.
"""

from __future__ import annotations

from hybridserve.workers.core.request import Request
from hybridserve.workers.speculative.proposer import Proposer


class MTPProposer(Proposer):
    def __init__(self, num_speculative_tokens: int) -> None:
        # The chained guesses after the first write KV at the positions after the request's.
        self.lookahead = num_speculative_tokens - 1

    def propose(self, batch: list[tuple[Request, int]]) -> list[list[int]]:
        drafts = []
        for request, count in batch:
            state = request.speculation
            assert state is not None
            drafts.append(state.pending[:count])
            state.pending = []
        return drafts
