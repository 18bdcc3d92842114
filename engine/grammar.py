"""Constrained decoding with llguidance: SGLang's `regex`, `json_schema` and `ebnf`.

Synopsis::

    grammars = Grammars(lltokenizer, n_vocab)          # once per model (runner)
    matcher = grammars.matcher("json_schema", schema)  # per request; BadRequest if invalid
    matcher.fill_mask(row)                             # per token, before sampling
    matcher.consume(token)                             # after sampling
    matcher.finished                                   # the grammar is complete

llguidance (one of SGLang's own grammar backends) compiles the grammar against the model's
vocabulary and computes, for each position, the set of tokens that keep the output inside the
grammar. Measured on SmolLM2 (49,152 tokens), computing and applying the mask costs 0.1-0.3
ms a token against a 6-11 ms decode (docs/benchmarks/README.md). Mask computation releases
the GIL.

How generation ends: once the text is a complete match, the mask lets the model's
end-of-generation tokens through (an open-ended grammar such as `[0-9]+` lets the model
decide); once nothing more can follow, `finished` is true and the engine stops with SGLang's
`{"type": "stop", "matched": <last token id>}`.

JSON schemas are compiled without flexible whitespace (`{"a":1}`, not `{ "a" : 1 }`): the
output is the same JSON, and small models otherwise drift into odd layouts (measured:
SmolLM2 put every comma on a line of its own).

Hostile grammars ("grammar bombs", docs/reliability.md). The client chooses what llguidance
compiles, in native code. Four layers keep one request from taking the
server down:

1. Bounds (engine/grammar_bounds.py), checked in pure Python before anything compiles: size,
   JSON nesting, objects and `$ref`s in a schema, regex nesting and counted repetitions, EBNF
   rules and nesting. A request over one is a 400 naming the limit.
2. llguidance's own limits (`LLParserLimits`), with less initial lexer fuel than its default
   (`INITIAL_LEXER_FUEL`), and the first token mask computed at compile time, so that a
   grammar whose lexer blows up is a 400 with llguidance's message ("too many expressions
   constructed") at submit instead of a matcher that silently allows only end-of-sequence.
3. Every grammar within the bounds is first converted and validated in a child process
   (engine/grammar_guard.py) that has a memory limit and is killed past a time limit: some
   grammars within every bound still take exponential memory or time in the compiler (an
   `allOf` of 24 `pattern`s aborted on a 5 GB allocation). Refused there is a 400; answers
   are cached, so a grammar seen before skips the child.
4. A validated grammar compiles here on dedicated threads with a `COMPILE_STACK_BYTES` stack
   (virtual: only the pages a compile touches cost memory). llguidance recurses along `$ref`
   and rule chains (measured: 3.3-8.9 KB of stack per `$ref`, 2.3 KB per chained EBNF rule),
   so the deepest compile the bounds allow needs 16-24 MiB: more than a default 8 MiB thread
   has, a tenth of a compile thread's. Waiting longer than `BUSY_TIMEOUT` for a free thread
   (or child) is a 503; a compile that runs longer than `COMPILE_TIMEOUT` a 400.

`Grammars.matcher` stays synchronous and may be called from any thread; it blocks its caller
(never the compile threads' other work) while the grammar compiles.
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .errors import BadRequest, GrammarCompilerBusy
from .grammar_bounds import ebnf_problem, json_schema_problem, regex_problem
from .grammar_guard import BUSY_TIMEOUT, LEXER_FUEL, STACK_BYTES, check_grammar, first_line

__all__ = [
    "BUSY_TIMEOUT",
    "COMPILE_STACK_BYTES",
    "COMPILE_THREADS",
    "COMPILE_TIMEOUT",
    "GRAMMAR_KINDS",
    "GrammarCompilerBusy",
    "Grammars",
    "LlgMatcher",
    "compile_on_big_stack",
]

T = TypeVar("T")

#: SGLang's sampling keys that carry a grammar, in the order it names them.
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


class LlgMatcher:
    """One request's position in its grammar. Used by one thread at a time (llguidance raises
    if a matcher is used from two at once)."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bitmask = allocate_token_bitmask(1, n_vocab)

    def copy(self) -> LlgMatcher:
        """A matcher at the same position in the same compiled grammar, with its own state
        (llguidance's deep_copy: about a microsecond), for the n copies of one request."""
        return LlgMatcher(self._matcher.deep_copy(), self._n_vocab)

    def fill_mask(self, row: np.ndarray) -> None:
        fill_next_token_bitmask(self._matcher, self._bitmask, 0)
        # One bit per token, little-endian within each 32-bit word. Unpacking and one masked
        # copy is several times faster than llguidance's own numpy helper (8-50 us vs
        # 170-260 us a row, measured).
        allowed = np.unpackbits(
            self._bitmask[0].view(np.uint8), count=self._n_vocab, bitorder="little"
        ).view(bool)
        np.copyto(row[: self._n_vocab], -np.inf, where=~allowed)

    def consume(self, token: int) -> None:
        # The mask only lets allowed tokens through, so this cannot fail for a sampled token;
        # if it did, the matcher's error state keeps the mask at end-of-generation only.
        self._matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        return bool(self._matcher.is_stopped())


#: Stack of each compile thread. Virtual: a compile touches what it uses (a typical schema a
#: few hundred KB); 256 MiB is 10 times what the deepest compile the bounds allow needed.
COMPILE_STACK_BYTES = STACK_BYTES
#: Compile threads (compiles run in parallel up to this; more wait their turn).
COMPILE_THREADS = 2
#: Seconds a caller waits for its grammar to compile, once a compile thread has taken it (the
#: wait for a free thread is BUSY_TIMEOUT, a 503), before giving up (a 400).
COMPILE_TIMEOUT = 10.0
#: llguidance's fuel for building the lexer (its default is 1,000,000): spent when the first
#: mask is computed. At 200,000 the lexer bombs measured (`a{1000000}`, `(a{1000}){1000}`, a
#: 1 MB literal) fail in 0.1-0.5 s instead of 1.4-3.7 s, and every real grammar measured
#: (OpenAI-sized schemas of 5,000 properties, 1,000-value enums, `[a-z]{1000}`) still compiles.
INITIAL_LEXER_FUEL = LEXER_FUEL


class Grammars:
    """Compiles requests' grammars against one model's vocabulary."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, n_vocab: int) -> None:
        self._tokenizer = tokenizer
        self._n_vocab = n_vocab
        self._limits = llguidance.LLParserLimits(
            initial_lexer_fuel=INITIAL_LEXER_FUEL, verbose_errors=False
        )
        self._compiling = 0
        self._idle = threading.Condition()

    def matcher(self, kind: str, source: str) -> LlgMatcher:
        """A matcher at the start of `source`; BadRequest naming the problem if the grammar
        is invalid or over a limit (checked here, before anything is queued). Synchronous,
        from any thread: the grammar is validated in a child process, then compiled on a
        compile thread (module docstring)."""
        _check_bounds(kind, source)  # here: pure Python, fast, nothing queued if refused
        check_grammar(kind, source)  # in a child process that can be limited and killed
        return compile_on_big_stack(lambda: self._compile(kind, source), what=kind)

    @property
    def compiling(self) -> int:
        """Compiles of this vocabulary still running, including any whose caller gave up
        waiting (they use the tokenizer, and so the model's vocabulary, until they end)."""
        with self._idle:
            return self._compiling

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no compile of this vocabulary runs (so the model may be freed); False
        if `timeout` seconds passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._compiling == 0, timeout)

    def _compile(self, kind: str, source: str) -> LlgMatcher:
        with self._idle:
            self._compiling += 1
        try:
            return self._compile_now(kind, source)
        finally:
            with self._idle:
                self._compiling -= 1
                self._idle.notify_all()

    def _compile_now(self, kind: str, source: str) -> LlgMatcher:
        grammar = _grammar(kind, source)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        result = LlgMatcher(matcher, self._n_vocab)
        if not matcher.is_error():
            # The first mask builds the lexer: where a lexer bomb goes off, so it goes off
            # here, as a 400, and not on the compute thread mid-batch.
            fill_next_token_bitmask(matcher, result._bitmask, 0)
        if matcher.is_error():
            raise BadRequest(f"Invalid {kind}: {first_line(matcher.get_error())}")
        return result


def compile_on_big_stack(fn: Callable[[], T], *, what: str = "grammar") -> T:
    """`fn()` on a compile thread (COMPILE_STACK_BYTES of stack); its result or its
    exception. Waits at most BUSY_TIMEOUT for a thread to take it (then a 503,
    GrammarCompilerBusy) and COMPILE_TIMEOUT for it to finish once taken (then a 400)."""
    job = _Job(fn)
    _compile_threads().put(job)
    if not job.started.wait(BUSY_TIMEOUT) and job.future.cancel():
        raise GrammarCompilerBusy(
            f"The grammar compiler is busy (no compile thread free within "
            f"{BUSY_TIMEOUT:g} s); try again."
        )
    try:
        return job.future.result(timeout=COMPILE_TIMEOUT)
    except concurrent.futures.TimeoutError:
        raise BadRequest(
            f"Invalid {what}: compiling it took longer than {COMPILE_TIMEOUT:g} s "
            "(the compile time limit); simplify the grammar."
        ) from None


class _Job:
    __slots__ = ("fn", "future", "started")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.started = threading.Event()


_threads_lock = threading.Lock()
_jobs: queue.SimpleQueue[_Job | None] | None = None


def _compile_threads() -> queue.SimpleQueue[_Job | None]:
    """The process's compile queue; its threads start on first use (all of them, or none)
    and live as long as the process (daemons: nothing to join, and a compile never holds
    anything to release)."""
    global _jobs
    with _threads_lock:  # also keeps two callers from setting the stack size at once
        if _jobs is None:
            jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
            started = 0
            # threading.stack_size is process-wide: set only while these threads start.
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                for i in range(COMPILE_THREADS):
                    threading.Thread(
                        target=_serve, args=(jobs,), name=f"grammar-compile-{i}", daemon=True
                    ).start()
                    started += 1
            except BaseException:
                for _ in range(started):
                    jobs.put(None)  # the ones that did start end: the next call starts anew
                raise
            finally:
                threading.stack_size(previous)
            _jobs = jobs
        return _jobs


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        if not job.future.set_running_or_notify_cancel():
            continue  # its caller gave up waiting
        job.started.set()
        try:
            result = job.fn()
        except BaseException as exc:  # handed to the caller, whatever it is
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
        del job


def _check_bounds(kind: str, source: str) -> None:
    """BadRequest naming the limit if `source` is over one (engine/grammar_bounds.py)."""
    check = {"json_schema": json_schema_problem, "regex": regex_problem, "ebnf": ebnf_problem}
    if problem := check[kind](source):
        raise BadRequest(f"Invalid {kind}: {problem}.")


def _grammar(kind: str, source: str) -> str:
    """llguidance's grammar for `source` (within the bounds); BadRequest if it is invalid."""
    if kind == "json_schema":
        try:
            json.loads(source)
        except ValueError as exc:
            raise BadRequest(f"Invalid json_schema: it is not valid JSON ({exc}).") from None
        try:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    source, defaults={"whitespace_flexible": False}
                )
            )
        except ValueError as exc:
            raise BadRequest(f"Invalid json_schema: {first_line(str(exc))}") from None
    if kind == "regex":
        try:
            return str(llguidance.grammar_from("regex", source))
        except ValueError as exc:
            raise BadRequest(f"Invalid regex: {first_line(str(exc))}") from None
    if kind == "ebnf":
        try:
            return str(llguidance.grammar_from("ebnf", source))
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"Invalid ebnf: {first_line(str(exc))}") from None
    raise AssertionError(f"unknown grammar kind {kind!r}")
