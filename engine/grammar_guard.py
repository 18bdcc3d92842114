"""Grammars checked in a child process before this process compiles them (issue 33).

Synopsis::

    check_grammar("json_schema", text)   # None, or BadRequest (400) / GrammarCompilerBusy (503)
    shutdown()                           # stop the children (also run at exit)

Some grammars within every bound in engine/grammar_bounds.py still make llguidance's compiler
take exponential memory or time, in native code that no thread can stop: a 650-byte schema
whose `allOf` intersects 24 `pattern`s aborted the process allocating 5 GB; an object with
1,000 `patternProperties` compiled for more than 190 s. So each grammar is first converted and
validated (llguidance's `validate_grammar`, which does the same work without a vocabulary) in
a child process that the operating system can bound and that this process can kill:

- `POOL_SIZE` long-lived children, started on first use with `subprocess` (fork + exec of
  this Python, never a bare fork of a process that holds threads and a model). A child imports
  only llguidance (about 30 MB, 50 ms).
- Each child limits its own address space (RLIMIT_AS) to `CHILD_MEMORY_BYTES` above what it
  holds when ready, its CPU time (RLIMIT_CPU) per job, and validates on a thread with a
  `COMPILE_STACK_BYTES` stack (the deepest schema within the bounds needs 16-24 MiB).
- The caller (`Grammars.matcher`, any thread, synchronous) waits at most `BUSY_TIMEOUT` for a
  free child (503 "busy" if none) and then `CHECK_TIMEOUT` for the answer: past it the child
  is killed (SIGKILL) and the grammar refused (400). A child that dies (out of memory: Rust's
  allocator aborts) is a 400 too; the next job starts a fresh child.
- Answers the grammar alone decides (accepted, or refused by llguidance) are kept in an LRU
  of `CACHE_SIZE` (kind, SHA-256 of the text): a grammar seen before skips the child. A
  refusal for time or memory is not kept (it depends on the machine's load too), and a child
  that dies of anything but running out of memory (a signal from outside, the OOM killer) is
  a 503 that says nothing of the grammar.
- A child runs isolated (`-I`) with this process's `sys.path`, in a session of its own (a
  Ctrl-C to the server's process group does not reach it), and writes no core file.

Only a grammar the child accepted is compiled in this process (engine/grammar.py), on the
big-stack compile threads.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import logging
import os
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time

from .errors import BadRequest, GrammarCompilerBusy

__all__ = [
    "BUSY_TIMEOUT",
    "CACHE_SIZE",
    "CHECK_TIMEOUT",
    "CHILD_MEMORY_BYTES",
    "POOL_SIZE",
    "check_grammar",
    "first_line",
    "shutdown",
]

#: Children checking grammars at once (the machines this runs on have 2 cores).
POOL_SIZE = 2
#: Seconds a caller waits for a free child before a 503.
BUSY_TIMEOUT = 5.0
#: Seconds a child may spend on one grammar before it is killed and the grammar refused (400).
#: Every real grammar measured checks in milliseconds (OpenAI's 5,000 properties: about 0.6 s).
CHECK_TIMEOUT = 5.0
#: Address space a child may add to what it holds when ready (RLIMIT_AS). Checking OpenAI's
#: maximal schema (5,000 properties, 1,000 enum values) peaked at about 60 MB.
CHILD_MEMORY_BYTES = 1 << 30
#: CPU seconds a child may spend on one job (RLIMIT_CPU, a backstop should this process die
#: without killing it).
CHILD_CPU_SECONDS = 30
#: Answers remembered (accepted and refused grammars alike).
CACHE_SIZE = 256
#: Seconds a child may take to start and say it is ready.
START_TIMEOUT = 30.0
#: Stack of the child's checking thread, and of the server's compile threads
#: (engine/grammar.py's COMPILE_STACK_BYTES, which explains the size). Virtual memory.
STACK_BYTES = 256 << 20
#: llguidance's initial lexer fuel, here and in the server's compile (engine/grammar.py's
#: INITIAL_LEXER_FUEL, which explains the value).
LEXER_FUEL = 200_000

#: What the child runs (`python -c`): length-prefixed JSON in on stdin, out on stdout. It
#: imports nothing but llguidance and the standard library.
CHILD = r"""
import json, os, signal, struct, sys, threading
sys.path[:] = json.loads(sys.argv[1])  # the server's own (the child runs with -I)
signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutdown is the parent's to decide
try:
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a memory bomb leaves no core file
except (ImportError, OSError, ValueError):
    pass
import llguidance

STACK, MEMORY, CPU, FUEL = (int(a) for a in sys.argv[2:6])
src, dst = sys.stdin.buffer, sys.stdout.buffer
limits = llguidance.LLParserLimits(initial_lexer_fuel=FUEL, verbose_errors=False)

def read():
    head = src.read(4)
    if len(head) < 4:
        os._exit(0)  # the parent is gone
    return json.loads(src.read(struct.unpack("<I", head)[0]))

def write(obj):
    data = json.dumps(obj).encode()
    dst.write(struct.pack("<I", len(data)) + data)
    dst.flush()

def check(kind, source):
    try:
        if kind == "json_schema":
            try:
                json.loads(source)
            except ValueError as exc:
                return ["json", str(exc)]
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                source, defaults={"whitespace_flexible": False})
        else:
            grammar = llguidance.grammar_from(kind, source)
    except (ValueError, RecursionError) as exc:
        return ["convert", str(exc)]
    error = llguidance.LLMatcher.validate_grammar(str(grammar), None, limits=limits)
    return ["validate", error] if error else None

def serve():
    try:
        import resource
        with open("/proc/self/status") as status:
            held = next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (held + MEMORY, held + MEMORY))
    except (ImportError, OSError, StopIteration, ValueError):
        resource = None
    write({"ready": os.getpid()})
    while True:
        job = read()
        if resource is not None:  # SIGXCPU (the end) past CPU more seconds
            used = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(used.ru_utime + used.ru_stime) + CPU
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        try:
            write({"refused": check(job["kind"], job["source"])})
        except MemoryError:
            write({"refused": ["memory", ""]})
        except BaseException as exc:  # a Rust panic (pyo3's PanicException) included
            write({"refused": ["error", f"{type(exc).__name__}: {exc}"]})

threading.stack_size(STACK)
thread = threading.Thread(target=serve)
thread.start()
thread.join()
"""


def check_grammar(kind: str, source: str) -> None:
    """None if `source` (a `kind` grammar within the bounds) converts and validates in a
    child; BadRequest naming why not; GrammarCompilerBusy if no child was free in time."""
    key = (kind, hashlib.sha256(source.encode("utf-8", "surrogatepass")).digest())
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            refusal = _cache[key]
            if refusal is None:
                return
            raise BadRequest(refusal)
    refusal, settled = _pool.check(kind, source)
    if settled:
        with _cache_lock:
            _cache[key] = refusal
            _cache.move_to_end(key)
            while len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    if refusal is not None:
        raise BadRequest(refusal)


def shutdown() -> None:
    """Stop every child (they are also stopped at exit, and exit when this process does);
    later checks start fresh ones."""
    _pool.close()


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def _refusal(kind: str, answer: list[str] | None) -> str | None:
    """The 400's message for the child's answer, worded as engine/grammar.py words its own."""
    if answer is None:
        return None
    stage, message = answer
    if stage == "json":
        return f"Invalid json_schema: it is not valid JSON ({message})."
    if stage == "memory":
        return _too_big(kind, "memory")
    return f"Invalid {kind}: {first_line(message)}"


def first_line(message: str) -> str:
    """llguidance's message without its trailing detail dump, short enough for a 400."""
    text = message.split("<non-verbose/>")[0].split("\n<state>")[0].strip() or "unknown error"
    if text == "NoExtensionBias":  # llguidance's word for "no text can match from here"
        text = "the grammar cannot match any text (NoExtensionBias)"
    return text if len(text) <= 500 else text[:497] + "..."


def _too_big(kind: str, what: str) -> str:
    limit = f"{CHILD_MEMORY_BYTES >> 20} MiB" if what == "memory" else f"{CHECK_TIMEOUT:g} s"
    return (
        f"Invalid {kind}: compiling it needs more {what} than the server allows "
        f"(the limit is {limit}); simplify the grammar."
    )


class _Child:
    """One checker process."""

    def __init__(self) -> None:
        args = (STACK_BYTES, CHILD_MEMORY_BYTES, CHILD_CPU_SECONDS, LEXER_FUEL)
        # -I: neither the working directory nor PYTHON* variables reach the child's path; it
        # gets this process's own (absolute entries), so it validates with the llguidance
        # this process compiles with. A session of its own: a Ctrl-C to the server's process
        # group is the server's to handle, not the checkers'.
        path = json.dumps([p for p in sys.path if os.path.isabs(p)])
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", CHILD, path, *map(str, args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,
                env={**os.environ, "RUST_BACKTRACE": "0"},
            )
        except (OSError, TypeError, ValueError) as exc:
            logger.warning("The grammar checker could not start: %s", exc)
            raise GrammarCompilerBusy("The grammar checker could not start; try again.") from None
        try:
            ready = self._read(time.monotonic() + START_TIMEOUT)
        except BaseException:
            self.kill()
            raise
        if ready is None or "ready" not in ready:
            self.kill()
            logger.warning("The grammar checker did not start (%s -I -c ...)", sys.executable)
            raise GrammarCompilerBusy("The grammar checker did not start; try again.")

    def check(self, kind: str, source: str) -> tuple[str | None, bool]:
        """The refusal's message (None: accepted), and whether the grammar alone settled it
        (so it may be remembered): a refusal for time or memory depends on the machine's
        load too. The child is dead afterwards if it ran out of memory or time. A child
        killed by anything else (a signal to the server's group, the OOM killer) says
        nothing of the grammar: GrammarCompilerBusy (503)."""
        data = json.dumps({"kind": kind, "source": source}).encode("utf-8", "surrogatepass")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(struct.pack("<I", len(data)) + data)
            self.proc.stdin.flush()
        except OSError:
            pass  # the child died: reading says so
        deadline = time.monotonic() + CHECK_TIMEOUT
        answer = self._read(deadline)
        if answer is None:  # out of time, or dead
            if self.proc.poll() is None and time.monotonic() >= deadline:
                self.kill()
                return _too_big(kind, "time"), False
            self.kill()
            if self.proc.returncode in _OUT_OF_MEMORY:
                return _too_big(kind, "memory"), False
            logger.warning("A grammar checker ended with %s", self.proc.returncode)
            raise GrammarCompilerBusy("The grammar checker stopped; try again.")
        refusal = answer["refused"]
        return _refusal(kind, refusal), refusal is None or refusal[0] != "memory"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass

    def _read(self, deadline: float) -> dict | None:
        """One message, or None if the child died or the deadline passed."""
        head = self._read_exactly(4, deadline)
        if head is None:
            return None
        size = struct.unpack("<I", head)[0]
        if size > _MAX_ANSWER_BYTES:
            return None
        body = self._read_exactly(size, deadline)
        if body is None:
            return None
        try:
            answer = json.loads(body)
        except ValueError:
            return None
        return answer if isinstance(answer, dict) else None

    def _read_exactly(self, n: int, deadline: float) -> bytes | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while got < n:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(fd, n - got)
                if not chunk:
                    return None
                chunks.append(chunk)
                got += len(chunk)
        return b"".join(chunks)


class _Pool:
    """POOL_SIZE slots; a slot holds a child once one has been started there."""

    def __init__(self) -> None:
        self._free: list[_Child | None] = [None] * POOL_SIZE
        self._all: set[_Child] = set()
        self._cond = threading.Condition()
        self._closed = False

    def check(self, kind: str, source: str) -> tuple[str | None, bool]:
        child = self._acquire()
        try:
            if child is None or not child.alive:
                if child is not None:
                    self._forget(child)
                child = _Child()
                with self._cond:
                    self._all.add(child)
            refusal = child.check(kind, source)
        except BaseException:
            if child is not None:
                child.kill()
                self._forget(child)
            self._release(None)
            raise
        if not child.alive:
            self._forget(child)
            child = None
        self._release(child)
        return refusal

    def close(self, at_exit: bool = False) -> None:
        with self._cond:
            children = list(self._all)
            self._all.clear()
            self._free = [None] * POOL_SIZE
            self._closed = at_exit
        for child in children:
            child.kill()

    def _acquire(self) -> _Child | None:
        deadline = time.monotonic() + BUSY_TIMEOUT
        with self._cond:
            while not self._free:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise GrammarCompilerBusy(
                        f"The grammar compiler is busy (no grammar checker free within "
                        f"{BUSY_TIMEOUT:g} s); try again."
                    )
                self._cond.wait(left)
            # A started child first.
            self._free.sort(key=lambda c: c is None)
            return self._free.pop(0)

    def _release(self, child: _Child | None) -> None:
        with self._cond:
            if self._closed or len(self._free) >= POOL_SIZE:
                if child is not None:
                    child.kill()
                    self._all.discard(child)
                return
            self._free.append(child)
            self._cond.notify()

    def _forget(self, child: _Child) -> None:
        child.kill()
        with self._cond:
            self._all.discard(child)


#: How a child that ran out of memory ends: Rust's allocator aborts, a failed allocation
#: elsewhere segfaults, RLIMIT_CPU sends SIGXCPU.
_OUT_OF_MEMORY = frozenset({-signal.SIGABRT, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGXCPU})
#: An answer is a verdict and a message: anything longer is not the child speaking.
_MAX_ANSWER_BYTES = 1 << 20

logger = logging.getLogger("tributary.grammar")
_pool = _Pool()
_cache: collections.OrderedDict[tuple[str, bytes], str | None] = collections.OrderedDict()
_cache_lock = threading.Lock()
atexit.register(_pool.close, at_exit=True)
