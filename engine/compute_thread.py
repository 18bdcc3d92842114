"""The one OS thread that runs every llama.cpp load and decode in this process, and the
eventfd handoff by which its results reach a waiting Trio task.

Synopsis::

    runner = await compute_thread().run(LlamaRunner.load, config, orphan=LlamaRunner.close)
    compute_thread().submit(free_slot, seq_id)  # queued behind the jobs before it, not waited for

- Jobs run one at a time, in the order they were queued (`run` and `submit` alike), so a
  job queued after a decode never runs under it.
- A caller of `run` waits for its job even when cancelled (the model is never freed under a
  running decode); only KeyboardInterrupt lets it leave early, and the result is then freed
  with `orphan`.
- The thread outlives every job, and the process's Trio runs: a failed job is logged and the
  next one runs.

Nothing here is llama-specific: it is the llama runner's because llama.cpp, built with
OpenMP, wants all its compute on one OS thread (`ComputeThread`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import outcome
import trio

from .grammar import _threads_lock

__all__ = ["STACK_BYTES", "ComputeThread", "compute_thread", "thread_stack_bytes"]

# The name these lines had before the thread left the llama runner: log filters select by it.
LOGGER = logging.getLogger("tributary.engine.llama")

#: The compute thread's stack, whatever the process's default. llama.cpp's tokenizer matches
#: many models' pre-tokenizer regex with std::regex, which recurses once per character of a
#: match: measured with llama.cpp's deepseek-llm vocabulary, a 10,000-letter word overflows a
#: 2 MiB stack, 40,000 letters overflow 8 MiB, and 64 MiB takes both. A thread's default
#: stack is RLIMIT_STACK's soft limit (8 MiB on most systems), but 2 MiB under `ulimit -s
#: unlimited` (glibc's fallback, common in GPU containers) and 128 KiB with musl. Virtual
#: memory: only the pages a call reaches are committed.
STACK_BYTES = 64 << 20

_T = TypeVar("_T")


class ComputeThread:
    """The one OS thread that runs every llama.cpp load and decode in this process.

    llama.cpp is built with OpenMP here, and OpenMP gives each calling OS thread its own team
    of workers. Once a process has more OpenMP workers than cores, libgomp stops spinning at
    barriers and sleeps on futexes instead, and ggml passes hundreds of barriers per decode.
    Decodes issued from Trio's thread cache land on different threads, so that happens as soon
    as two cache threads have decoded: measured, a 4-sequence step went from 19.5 ms to
    40.8 ms and stayed there. One thread for all compute keeps one team.

    The thread outlives every job: a job's failure (any exception, and a result that can no
    longer be delivered because its Trio run has ended) is logged or cleaned up, and the next
    job runs. It lives as long as the process, so a later `trio.run` in the same process
    (a program that caught Ctrl-C, a test suite) finds it serving.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._work, args=(self._jobs,), name="llama-compute", daemon=True
        )
        # threading.stack_size is process-wide: set only while this thread starts, under the
        # lock the grammar compile threads set theirs under.
        with _threads_lock:
            previous = threading.stack_size(STACK_BYTES)
            try:
                self._thread.start()
            finally:
                threading.stack_size(previous)

    @staticmethod
    def _work(jobs: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (job := jobs.get()) is not None:
            try:
                job()
            except BaseException:  # the thread must outlive any job; the next one still runs
                fn = getattr(job, "func", job)  # submit's partial, or run's job
                LOGGER.exception("compute thread job %s failed", getattr(fn, "__name__", fn))

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue `fn(*args)` behind the jobs already queued, without waiting for it. A
        failure is logged; the thread carries on."""
        self._jobs.put(functools.partial(fn, *args))

    def wait_idle(self) -> None:
        """Block until every job queued so far has run (for shutdown, off the hot path). On
        the compute thread itself (a job cleaning up) nothing else can be running, so it
        returns at once."""
        if threading.current_thread() is self._thread:
            return
        done = threading.Event()
        self._jobs.put(done.set)
        done.wait()

    @trio.lowlevel.enable_ki_protection
    async def run(
        self,
        fn: Callable[..., _T],
        *args: Any,
        orphan: Callable[[_T], object] | None = None,
        feed: Callable[[list[Any]], None] | None = None,
        interrupt: Callable[[], None] | None = None,
        published: Callable[[Callable[[], None]], None] | None = None,
    ) -> _T:
        """Run `fn(*args)` on the compute thread and return its result.

        With `feed`, `fn` is called with one more argument, `publish(item, wake)`, to hand
        items over while it runs (it returns how many wait to be taken): each reaches `feed`
        (a list of the items published since the last call, in order) in the caller's task,
        at once if `wake`, else with the next item that wakes or with the result, and
        always before the result is returned. If `feed` raises, the call is interrupted and
        waited for, what it publishes afterwards is dropped, and the error is raised here.
        `interrupt` is called (on the event loop) when the caller is cancelled or leaves, for
        a long call that can end early: the call is still waited for. `published(feed_now)`
        is called once, before the call is queued, with a function that feeds the items
        published so far at once, from any task on the event loop, with the same handling
        of a failing `feed`.

        Cancellation waits for the call to finish (a decode takes at most a step), then takes
        effect at the caller's next checkpoint: the model is never freed under a running
        decode. KeyboardInterrupt is different: Trio delivers it to the main task even in a
        shielded wait, so a caller there (`open_engine` loading a model) leaves at once and
        its Trio run may end before the call does. The result is then nobody's: `orphan`
        (say, a loaded model's `close`) is called on it on the compute thread, and the
        thread carries on with the next job. (KeyboardInterrupt is let in only at the
        waits, so no other point can lose the result or the wakeup.)

        The caller waits for a file descriptor to become readable, which the compute thread
        makes so as it delivers the result (`_Wakeup.set`): Trio's epoll wakes the caller
        directly, in the same pass of its run loop. `run_sync_soon` would take one more pass
        (its queue's own task runs the callback, which wakes the caller) and two more reads
        of Trio's wake-up socket, for every step.
        """
        wakeup = _Wakeup.take()
        handoff: _Handoff[_T] = _Handoff(wakeup)  # not _Handoff[_T](): typing's call is slow
        call_args = (*args, handoff.publish) if feed is not None else args
        failure: list[Exception] = []

        def feed_now(items: list[Any]) -> None:
            if not items or feed is None or failure:
                return
            try:
                feed(items)
            except Exception as exc:
                failure.append(exc)
                handoff.drop_items()  # nothing after a lost item may be fed
                if interrupt is not None:
                    interrupt()

        if published is not None:
            published(lambda: feed_now(handoff.take_published()))

        def job() -> None:
            result = outcome.capture(fn, *call_args)
            if not handoff.deliver(result):
                _free_orphan(result, orphan)  # the caller has already left

        self._jobs.put(job)
        shielded = False
        try:
            while True:
                if shielded:
                    with trio.CancelScope(shield=True):
                        await wakeup.wait()
                else:
                    try:
                        await wakeup.wait()
                    except trio.Cancelled:
                        # Wait for the call all the same; the cancellation stays pending in
                        # its scope and takes effect at the caller's next checkpoint. (A
                        # shielded scope around every wait would do the same, at a cost on
                        # every step.)
                        shielded = True
                        if interrupt is not None:
                            interrupt()
                        with trio.CancelScope(shield=True):
                            await wakeup.wait()
                items, result = handoff.take()
                feed_now(items)
                if result is not None:
                    break
        except BaseException:
            if interrupt is not None:
                interrupt()
            self._leave(handoff, wakeup, orphan)
            raise
        handoff.abandon()
        wakeup.give_back()
        if failure:
            raise failure[0]
        assert result is not None, "the loop ends with the result"
        return result.unwrap()

    def _leave(
        self, handoff: _Handoff[_T], wakeup: _Wakeup, orphan: Callable[[_T], object] | None
    ) -> None:
        """A caller leaves before taking its result (KeyboardInterrupt): nothing is delivered
        to it any more, what was delivered is freed, and its wakeup, set or not, is closed."""
        leftover = handoff.abandon()
        wakeup.close()  # never reused: it may have been set
        if leftover is not None:  # delivered, but this caller will never take it
            self.submit(_free_orphan, leftover, orphan)


class _Wakeup:
    """A file descriptor that a Trio task waits on until another thread makes it readable:
    an eventfd (a socket pair where there is none; Trio waits only on sockets on Windows).
    Wakeups are pooled, process-wide: a step's wait re-arms an fd Trio's epoll already knows
    (one `epoll_ctl`) instead of opening and closing one. Only a consumed wakeup goes back.

    `set` writes the eventfd *holding the GIL* (libc through `ctypes.PyDLL`). The thread
    that sets it is the compute thread between two decodes, and the event loop it wakes
    wants the GIL at once: had the write released it (as `os.eventfd_write` does), the
    compute thread would have to win it back from the event loop's whole burst of work
    (commit, detokenize, send) before starting the next decode (measured before: 0.5-0.7
    ms a token at concurrency 1, on a 6-7 ms decode). Holding it, the compute thread runs on
    to that decode, whose `llama_decode` releases the GIL to the event loop a few
    microseconds later. (A second thread that did the write instead cost the compute thread
    about 30 µs a step to hand it over, between two decodes, and 0.04 ms of CPU a token.)
    """

    _pool: ClassVar[list[_Wakeup]] = []

    def __init__(self) -> None:
        self._eventfd: int | None = None
        self._pair: tuple[socket.socket, socket.socket] | None = None
        if hasattr(os, "eventfd"):
            # Non-blocking: a write with the GIL held must never wait (the counter is at
            # most 1 anyway: set once, read before the wakeup is reused).
            self._eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        else:  # pragma: no cover - not Linux
            self._pair = socket.socketpair()

    @classmethod
    def take(cls) -> _Wakeup:
        try:
            return cls._pool.pop()  # atomic under the GIL, so any thread's Trio run may call
        except IndexError:
            return cls()

    def set(self) -> None:
        """Make the fd readable; from any thread."""
        if self._eventfd is not None:
            if _eventfd_write is None:  # pragma: no cover - a libc without eventfd_write
                os.eventfd_write(self._eventfd, 1)  # releases the GIL: slower, still right
            elif _eventfd_write(self._eventfd, 1) != 0:
                raise OSError(ctypes.get_errno(), "eventfd_write failed")
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            self._pair[1].send(b"\0")

    async def wait(self) -> None:
        """Wait until `set`, then consume it (so the fd can serve the next wait)."""
        if self._eventfd is not None:
            await trio.lowlevel.wait_readable(self._eventfd)
            os.eventfd_read(self._eventfd)
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            await trio.lowlevel.wait_readable(self._pair[0])
            self._pair[0].recv(8)

    def give_back(self) -> None:
        """Return a consumed wakeup to the pool; nothing may set it meanwhile."""
        self._pool.append(self)

    def close(self) -> None:
        """For a wait that was left: the fd may or may not have been set, so it is not reused."""
        if self._eventfd is not None:
            os.close(self._eventfd)
        else:  # pragma: no cover - not Linux
            assert self._pair is not None
            for sock in self._pair:
                sock.close()


def _libc_eventfd_write() -> Callable[[int, int], int] | None:
    """The C library's `eventfd_write` (glibc and musl have it), called without releasing
    the GIL; None where there is none."""
    if not hasattr(os, "eventfd"):
        return None  # pragma: no cover - not Linux
    try:
        # dlopen(NULL): the libc this process already runs on, whichever it is.
        fn = ctypes.PyDLL(None, use_errno=True).eventfd_write
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        LOGGER.warning("no eventfd_write in the C library: waking steps releases the GIL")
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_uint64)
    fn.restype = ctypes.c_int
    return fn


_eventfd_write = _libc_eventfd_write()


class _Handoff(Generic[_T]):
    """What the compute thread passes to a waiting Trio task: items published while a call
    runs, then its result; or left behind when that task has gone: whichever side comes
    second sees what the other did. The waiter is woken under the same lock, so never once
    it has abandoned the handoff (it may then close its wakeup's fd), and at most once per
    `take` (the eventfd is not written again while a wakeup is pending)."""

    def __init__(self, wakeup: _Wakeup) -> None:
        self._lock = threading.Lock()
        self._result: outcome.Outcome[_T] | None = None
        self._items: list[Any] = []
        self._woken = False
        self._abandoned = False
        self._dropping = False
        self._wakeup = wakeup

    def publish(self, item: Any, wake: bool) -> int:
        """Queue `item` for the waiter, waking it if `wake` (compute thread); returns how
        many items wait to be taken."""
        with self._lock:
            if self._abandoned:
                return 0
            self._items.append(item)
            if wake and not self._woken:
                self._woken = True
                self._wakeup.set()
            return len(self._items)

    def deliver(self, result: outcome.Outcome[_T]) -> bool:
        """Hand `result` over and wake the waiter; False if the waiter has already left
        (the result is the caller's to free)."""
        with self._lock:
            if self._abandoned:
                return False
            self._result = result
            if not self._woken:
                self._woken = True
                self._wakeup.set()
            return True

    def take(self) -> tuple[list[Any], outcome.Outcome[_T] | None]:
        """For a waiter just woken: the items published since the last take, and the result
        if it has been delivered."""
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
            return items, self._result

    def take_published(self) -> list[Any]:
        """The items published since the last take, without waiting for a wakeup (the one
        that may be pending then finds them gone); none once the feed has failed."""
        with self._lock:
            items, self._items = self._items, []
            return [] if self._dropping else items

    def drop_items(self) -> None:
        """From now on items are taken and thrown away (the feed failed)."""
        with self._lock:
            self._dropping = True
            self._items = []

    def abandon(self) -> outcome.Outcome[_T] | None:
        """Take what was delivered (None if nothing yet); nothing is delivered after this."""
        with self._lock:
            self._abandoned = True
            result, self._result = self._result, None
            self._items = []
            return result


def _free_orphan(result: outcome.Outcome[_T] | None, orphan: Callable[[_T], object] | None) -> None:
    if orphan is None or not isinstance(result, outcome.Value):
        return
    LOGGER.warning("freeing a result nobody collected: %r", result.value)
    try:
        orphan(result.value)
    except Exception:
        LOGGER.exception("freeing an uncollected result failed")


def thread_stack_bytes() -> int | None:
    """The calling thread's stack size in bytes (glibc's `pthread_getattr_np`); None where
    it cannot be read."""
    try:
        libc = ctypes.CDLL(None)
        getattr_np = libc.pthread_getattr_np
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return None
    attr = ctypes.create_string_buffer(256)  # pthread_attr_t: 56 bytes on x86-64 glibc
    libc.pthread_self.restype = ctypes.c_ulong
    if getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) != 0:
        return None  # pragma: no cover
    try:
        address, size = ctypes.c_void_p(), ctypes.c_size_t()
        if libc.pthread_attr_getstack(attr, ctypes.byref(address), ctypes.byref(size)) != 0:
            return None  # pragma: no cover
        return size.value
    finally:
        libc.pthread_attr_destroy(attr)


_compute_thread: ComputeThread | None = None
_compute_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """The process's compute thread, started on first use; it lives as long as the process."""
    global _compute_thread
    with _compute_lock:
        if _compute_thread is None:
            _compute_thread = ComputeThread()
        return _compute_thread
