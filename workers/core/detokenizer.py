"""Incremental detokenization: the text each new batch of tokens adds to a stream."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Text deltas of a growing token list, holding back an incomplete UTF-8 tail.

    Decodes only a short window per call (vLLM's prefix/read offsets), not the whole output:

        token_ids: | emitted and settled ...... | prefix | read ...... |
                                                ^ prefix_offset       (text of the prefix
                                                         ^ read_offset  window is known)
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    @property
    def holding(self) -> bool:
        """Tokens whose text is not out yet (a character still missing bytes, or a window
        that decoded to nothing new). Never, without a tokenizer: there is no text to wait
        for."""
        return self.tokenizer is not None and self.read_offset < len(self.token_ids)

    def feed(self, token_ids: list[int], final: bool) -> str:
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        window = self.token_ids[self.prefix_offset :]
        prefix_text = self.tokenizer.decode(window[: self.read_offset - self.prefix_offset])
        text = self.tokenizer.decode(window)
        if not final and (len(text) <= len(prefix_text) or text.endswith("\ufffd")):
            return ""  # nothing new, or a character still missing bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix_text) :]
