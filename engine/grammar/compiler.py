"""Compiling a request's grammar against the tokenizer, and each sequence's matcher.

``Grammars`` (one per engine) compiles off the step loop on a ``DeadlinePool``: at most
``grammar_compile_threads`` at once, each within ``grammar_compile_timeout_s``. Results are
cached by the grammar's text (failures too: a grammar that overran its bound or that no token
can start fails again at once, without compiling again; one that only waited too long for a
thread is compiled again by the next request). A compiled grammar is checked with the
tokenizer (``language.first_token_possible``). The scheduler admits a request once its
grammar is compiled; a request whose compile failed is failed with the ``ValueError``, which
names its field (a Worker answers it with a 400).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from engine.grammar.deadline_pool import CompileTimeout, DeadlinePool
from engine.grammar.language import first_token_possible
from engine.grammar.structured_output import StructuredOutputsParams, parse_grammar

if TYPE_CHECKING:
    import xgrammar
    from transformers import PreTrainedTokenizerBase

_CACHE_SIZE = 256  # compiled grammars kept per engine


class GrammarState:
    """One sequence's progress through its grammar (the matcher, once compiled)."""

    def __init__(self, compiled: Future[xgrammar.CompiledGrammar]) -> None:
        self.compiled = compiled
        self._matcher: xgrammar.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled, and usable."""
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def error(self) -> Exception | None:
        """Why the grammar cannot be used (None while it compiles, or once it has)."""
        error = self.compiled.exception() if self.compiled.done() else None
        return error if error is None or isinstance(error, Exception) else RuntimeError(error)

    @property
    def matcher(self) -> xgrammar.GrammarMatcher:
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result())
        return self._matcher

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not continue the request's grammar")

    @property
    def terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class Grammars:
    """Compiles grammars for one tokenizer within a time bound, caching the results."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 stop_token_ids: Iterable[int], timeout_s: float = 10.0,
                 threads: int = 2) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.pool = DeadlinePool(threads, timeout_s, "grammar_compile_timeout_s")
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()  # the cache's
        self._compiler_lock = threading.Lock()
        self._failures, self._failures_seen = 0, 0  # failed compiles: noted, and taken
        self._failures_lock = threading.Lock()

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A new sequence's state; its grammar compiles in the background (or is cached)."""
        key = params.key()
        with self._lock:
            cached = self._cache.get(key)
            future = cached
            if future is None or _retry(future):
                future = self.pool.submit(lambda: self._compile(key),
                                          f"structured_outputs.{key[0]}")
                future.add_done_callback(self._note_failure)
                self._cache[key] = future
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        if future is cached:
            self._note_failure(future)  # a cached failure fails this request too
        return GrammarState(future)

    def _note_failure(self, future: Future[xgrammar.CompiledGrammar]) -> None:
        if future.done() and future.exception() is not None:
            with self._failures_lock:
                self._failures += 1

    def take_failed(self) -> bool:
        """Whether a compile failed (or timed out) since the last call (one caller: the step
        loop): then the waiting requests' grammars are worth a look. Call ``expire`` first."""
        failures = self._failures
        if failures == self._failures_seen:
            return False
        self._failures_seen = failures
        return True

    def expire(self) -> None:
        """Fail compiles past their time bound (see ``DeadlinePool``)."""
        self.pool.expire()

    def _compile(self, key: tuple[str, str]) -> xgrammar.CompiledGrammar:
        kind, _ = key
        try:
            compiled = self._grammar_compiler().compile_grammar(parse_grammar(*key))
        except (RuntimeError, ValueError) as e:  # xgrammar reports its errors as RuntimeError
            if str(e).startswith(f"structured_outputs.{kind}"):
                raise  # parse_grammar's, naming the field already
            detail = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"structured_outputs.{kind} could not be compiled: "
                             f"{detail[:300]}") from None
        if not first_token_possible(compiled):
            raise ValueError(f"structured_outputs.{kind} is unsatisfiable with this model's "
                             "tokenizer: no token can start an output it accepts")
        return compiled

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        with self._compiler_lock:  # building the vocabulary's tables takes a while: once
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    @staticmethod
    def wait_any(states: list[GrammarState], timeout: float) -> None:
        """Block until one of ``states`` is compiled (or failed), at most ``timeout`` s."""
        pending = [s.compiled for s in states if not s.compiled.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)


def _retry(future: Future[xgrammar.CompiledGrammar]) -> bool:
    """Whether a cached compile is tried again: only one that waited too long for a thread
    (the grammar's own failures, an overrun included, stay)."""
    if not future.done():
        return False
    error = future.exception()
    return isinstance(error, CompileTimeout) and not error.started
