"""Incremental detokenization equals decoding the whole output at once."""

from __future__ import annotations

import random

from hybridserve.workers.core.detokenizer import Detokenizer
from hybridserve.workers.models.tiny import tiny_tokenizer


def test_deltas_join_to_the_full_text_and_never_split_a_character():
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode("héllo wörld — ünïcode ✓ 🙂 end", add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        detokenizer, deltas, position = Detokenizer(tokenizer), [], 0
        while position < len(token_ids):
            step = rng.randint(1, 3)
            chunk = token_ids[position : position + step]
            position += step
            deltas.append(detokenizer.feed(chunk, final=position >= len(token_ids)))
        assert "".join(deltas) == tokenizer.decode(token_ids)
        assert not any("\ufffd" in d for d in deltas)


def test_a_final_incomplete_character_is_emitted_as_decoded():
    tokenizer = tiny_tokenizer()
    token_ids = tokenizer.encode("ok 🙂", add_special_tokens=False)[:-1]
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.feed(token_ids[:3], final=False) == "ok "
    assert detokenizer.feed(token_ids[3:], final=True) == tokenizer.decode(token_ids)[3:]
