"""Stop strings: cut streamed text at the first match, never emitting the stop string itself.

Matched where text is made, not in the engine (which stops on token ids): the OpenAI server
feeds each detokenized delta of a choice through one `StopStringMatcher`, `LLM` each
request's (`SamplingParams.stop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopMatch:
    text: str  # safe to emit now
    stopped: bool  # a stop string was hit: `text` ends right before it, and nothing follows
    stop: str | None = None  # the stop string hit (first in the text)


class StopStringMatcher:
    """Cuts streamed text at the first stop string; the stop string itself is not emitted.

    Text that could still become a stop string is held back until the next delta decides it:

        emitted | held (a proper prefix of some stop) | next delta ...

    Call `flush()` when generation ends without a hit to release the held text.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        assert all(stops), "empty stop strings match everywhere"
        self._stops = tuple(stops)
        self._held = ""
        self._stopped = False

    def feed(self, delta: str) -> StopMatch:
        if self._stopped:
            return StopMatch("", True)
        text = self._held + delta
        hits = [(text.find(stop), stop) for stop in self._stops if stop in text]
        if hits:
            self._held, self._stopped = "", True
            position, stop = min(hits)
            return StopMatch(text[:position], True, stop)
        keep = max((self._overlap(text, stop) for stop in self._stops), default=0)
        self._held = text[len(text) - keep :]
        return StopMatch(text[: len(text) - keep], False)

    @property
    def holding(self) -> bool:
        """Text is held back (it could still become a stop string)."""
        return bool(self._held)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _overlap(text: str, stop: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
        for length in range(min(len(text), len(stop) - 1), 0, -1):
            if stop.startswith(text[-length:]):
                return length
        return 0
