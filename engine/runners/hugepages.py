"""Model weights in 2 MiB pages.

A decode reads every weight of the model once, so at one request a token costs about as much
as streaming the weights through the caches (SmolLM2-135M Q4_1: 93 MiB a token). Mapped from
the GGUF file, as llama.cpp does by default, the weights sit in the page cache in 4 KiB
pages: some 24,000 pages a token, each a TLB entry to walk to. Read into anonymous memory and
collapsed into transparent huge pages, they take some 47. Measured on these machines
(docs/benchmarks/README.md, "Weights in huge pages"): a plain decode loop at one request is
0-5% faster a token with the weights in huge pages (2.6% in the recorded run, as the
machine's state allows; within the noise at 16), anonymous memory in 4 KiB pages no faster
than the mapped file, and over HTTP a unary request 4-6% faster than on the same server with
the weights mapped (a streamed one 1%).

Linux only. llama.cpp allocates the buffer itself (`posix_memalign`, which glibc serves with
a fresh `mmap` at this size), so the buffer is found as the anonymous memory that loading
the model added to the process (`fresh_ranges`), collapsed 2 MiB at a time. Memory another
thread mapped meanwhile may be advised with it: a region of it never written is refused on
its own, and one partly written is filled out to 2 MiB (at most a few MiB in all). The
buffer's two ends, where a 2 MiB page would hold other memory too, stay in 4 KiB pages.
`MADV_COLLAPSE` (Linux 6.1) moves the pages already written into huge pages at once,
whatever /sys/kernel/mm/transparent_hugepage/enabled says; `MADV_HUGEPAGE` first, so that
the kernel keeps them that way. Where the collapse is refused, the weights stay in 4 KiB
pages of the process's own (as fast as the mapped file, but not shared with the page cache),
and `HugePages.error` says why; an older kernel that took `MADV_HUGEPAGE` may still collapse
them later, in the background (khugepaged).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import mmap
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "HUGE_PAGE",
    "HugePages",
    "anonymous_ranges",
    "back_with_huge_pages",
    "collapse_available",
    "fresh_ranges",
    "huge_bytes",
]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class HugePages:
    """What `back_with_huge_pages` did: bytes advised, bytes the kernel reports in huge
    pages there afterwards, and why not all of it when something was refused."""

    advised: int
    huge: int
    error: str | None = None


def anonymous_ranges(maps: Path = Path("/proc/self/maps")) -> list[Range]:
    """The process's private anonymous read-write mappings, as [start, end) addresses."""
    ranges = []
    try:
        text = maps.read_text()
    except OSError:
        return []
    for line in text.splitlines():
        fields = line.split()
        # address perms offset dev inode [path]: anonymous memory has no path (the heap
        # and stacks have a bracketed one and are left alone).
        if len(fields) == 5 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def fresh_ranges(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of `after` in none of `before`, cut to whole huge pages. The kernel merges a
    new mapping with a neighbour of the same kind, so a range of `after` can hold old memory
    as well as new."""
    fresh = []
    for start, end in after:
        pieces = [(start, end)]
        for old_start, old_end in before:
            kept = []
            for s, e in pieces:
                if old_end <= s or e <= old_start:
                    kept.append((s, e))  # apart from the old range
                else:  # what lies either side of it
                    kept += [p for p in ((s, old_start), (old_end, e)) if p[0] < p[1]]
            pieces = kept
        for s, e in pieces:
            s, e = -(-s // HUGE_PAGE) * HUGE_PAGE, e // HUGE_PAGE * HUGE_PAGE
            if s < e:
                fresh.append((s, e))
    return fresh


def huge_bytes(ranges: list[Range], smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of `ranges` that the kernel reports in huge pages (AnonHugePages of the mappings
    that lie inside them: advising a range makes it a mapping of its own)."""
    total = 0
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    # Neighbouring ranges advised alike become one mapping: coalesce them first.
    spans: list[list[int]] = []
    for start, end in sorted(ranges):
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(s <= start and end <= e for s, e in spans)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def back_with_huge_pages(ranges: list[Range], expected: int) -> HugePages:
    """Advise `ranges` (written already) into huge pages and collapse them now, 2 MiB at a
    time: a region another thread mapped next to the weights and never wrote is refused
    (EINVAL) on its own, without keeping the weights' regions from being collapsed. Success
    is `expected` bytes in huge pages, less the two ends that may share a page with other
    memory; short of that, `error` names the first refusal."""
    if not ranges:
        return HugePages(0, 0, "no anonymous memory was added by the load")
    advised = sum(e - s for s, e in ranges)
    madvise = _madvise()
    if madvise is None:
        return HugePages(advised, 0, "madvise is not available on this system")
    refused: tuple[int, str] | None = None
    for start, end in ranges:
        calls = [(start, end - start, _MADV_HUGEPAGE, "MADV_HUGEPAGE")]
        calls += [
            (a, HUGE_PAGE, _MADV_COLLAPSE, "MADV_COLLAPSE") for a in range(start, end, HUGE_PAGE)
        ]
        for address, length, advice, name in calls:
            code = _advise(madvise, address, length, advice)
            # A region another thread never wrote is refused with EINVAL: any other refusal
            # says more about the weights.
            if code and (refused is None or refused[0] == errno.EINVAL):
                refused = (code, f"{name}: {os.strerror(code)} ({errno.errorcode.get(code, code)})")
    huge = huge_bytes(ranges)
    if huge > 0 and huge >= expected - 2 * HUGE_PAGE:
        return HugePages(advised, huge)
    return HugePages(
        advised, huge, refused[1] if refused else "the kernel kept them in 4 KiB pages"
    )


def collapse_available() -> bool:
    """Whether this kernel collapses written memory into huge pages (`MADV_COLLAPSE`, Linux
    6.1, THP not disabled for the process): tried on 4 MiB of memory of its own."""
    memory = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_NOHUGEPAGE)
        memory.write(b"\x01" * len(memory))
        memory.madvise(mmap.MADV_HUGEPAGE)
        memory.madvise(_MADV_COLLAPSE)
    except (OSError, AttributeError, ValueError):
        return False
    finally:
        memory.close()
    return True


def _advise(madvise: Callable[[int, int, int], int], address: int, length: int, advice: int) -> int:
    """0, or the errno of the kernel's refusal (EAGAIN, transient by madvise(2), is retried
    once)."""
    code = 0
    for _ in range(2):
        if madvise(address, length, advice) == 0:
            return 0
        code = ctypes.get_errno()
        if code != errno.EAGAIN:
            break
    return code


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # the C library already loaded
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
