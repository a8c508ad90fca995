"""Structured output: a request's output constrained by a grammar, through llguidance.

llguidance (the Rust library behind Guidance, one of vLLM's structured-output backends) was
picked over xgrammar because it builds a JSON-schema, regex, choice or Lark grammar in
milliseconds with no per-schema compile step worth caching, computes a token mask in tens of
microseconds on the CPU without touching torch, and pulls in no further dependency.

    engine.add_request ── GrammarCompiler.compile(spec) ──> Grammar (an LLMatcher)
    scheduler._sampling_rows ── grammar.bitmask() ──> SamplingRow.allowed_token_bitmask
    sampler ── disallowed tokens -inf ──> token
    scheduler._append ── grammar.accept(token)

A grammar that is complete allows only the end-of-sequence tokens, so the request stops there.
The state follows the request's output tokens and nothing else, which keeps it correct across
a preemption (the output tokens stay, only their KV is recomputed) and after a P/D hand-off
(the decode engine compiles the same spec and accepts the first token the prefill engine
drew). The n choices of a request fork it (`fork`) before each accepts its own first token.
"""

from __future__ import annotations

import json
import threading

import llguidance
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from hybridserve.workers.core.sampling_params import StructuredOutput
from hybridserve.workers.core.tokenizer import Tokenizer

# Compact JSON: a model may not pad its output with unbounded whitespace.
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'


class Grammar:
    """Where one request's output stands in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def bitmask(self) -> bytes:
        """The tokens allowed next: bit t of 32-bit little-endian word t // 32."""
        return self.matcher.compute_bitmask()

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            # The sampler only draws allowed tokens; this is a bug, not a user error.
            raise RuntimeError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids`, from the first, the grammar would accept in a row (the
        state does not change)."""
        return self.matcher.validate_tokens(token_ids)

    def bitmasks_along(self, token_ids: list[int]) -> list[bytes]:
        """The bitmask now and after each of `token_ids` (which it must accept), the state
        unchanged afterwards: the masks of a verify step's rows."""
        masks = [self.bitmask()]
        for token_id in token_ids:
            self.accept(token_id)
            masks.append(self.bitmask())
        if token_ids and not self.matcher.rollback(len(token_ids)):
            raise RuntimeError(f"the grammar could not roll back: {self.matcher.get_error()}")
        return masks

    def fork(self) -> Grammar:
        return Grammar(self.matcher.deep_copy())

    @property
    def is_complete(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles specs against one tokenizer (the llguidance view of it is built once: about
    a second for a large vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self._vocab_size,
                    eos_token=self._eos_token_ids,
                )
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput) -> Grammar:
        """A fresh grammar state for `spec`; ValueError naming the problem if it is invalid."""
        grammar = _grammar_text(spec)
        tokenizer = self._ll()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"invalid {spec.kind} for structured output: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind} for structured output: {matcher.get_error()}")
        return Grammar(matcher)


def _grammar_text(spec: StructuredOutput) -> str:
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(
                ANY_JSON_OBJECT, defaults=JSON_OPTIONS
            )
        if spec.kind == "json_schema":
            json.loads(spec.spec)  # a clear message for text that is not JSON at all
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise ValueError("choice needs a non-empty list of strings")
            return llguidance.grammar_from("choice", spec.spec)
        # vLLM's and SGLang's grammars are EBNF (GBNF); Lark passes through unchanged.
        return llguidance.grammar_from("grammar", any_to_lark(spec.spec))
    except (ValueError, RuntimeError, GbnfToLarkError) as exc:
        raise ValueError(f"invalid {spec.kind} for structured output: {exc}") from exc
