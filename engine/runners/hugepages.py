"""Model weights in 2 MiB pages.

A decode reads every weight of the model once, so at one request a token costs about as much
as streaming the weights through the caches (SmolLM2-135M Q4_1: 93 MiB a token). Mapped from
the GGUF file, as llama.cpp does by default, the weights sit in the page cache in 4 KiB
pages: some 24,000 pages a token, each a TLB entry to walk to. Read into anonymous memory and
collapsed into transparent huge pages, they take some 47. Measured on these machines
(docs/benchmarks/README.md, "Weights in huge pages"): a plain decode loop is 4.5% faster a
token with the weights in huge pages, while anonymous memory in 4 KiB pages is no faster
than the mapped file.

Linux only. llama.cpp allocates the buffer itself (`posix_memalign`, which glibc serves with
a fresh `mmap` at this size), so the buffer is found as the anonymous memory that loading
the model added to the process (`fresh_ranges`); memory another thread allocated meanwhile
may be advised with it, which costs nothing but its pages' granularity, and the buffer's two
ends, where a 2 MiB page would hold other memory too, stay in 4 KiB pages. `MADV_COLLAPSE`
(Linux 6.1) moves the pages already written into huge pages at once, whatever
/sys/kernel/mm/transparent_hugepage/enabled says; `MADV_HUGEPAGE` first, so that the kernel
keeps them that way. Where either is refused, the weights stay in 4 KiB pages, which works
exactly as before, and `HugePages.error` says why.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
from collections.abc import Callable
from pathlib import Path

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
            pieces = [
                piece
                for s, e in pieces
                for piece in (
                    [(s, e)] if old_end <= s or e <= old_start else [(s, old_start), (old_end, e)]
                )
                if piece[0] < piece[1]
            ]
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
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = any(s <= start and end <= e for s, e in ranges)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def back_with_huge_pages(ranges: list[Range]) -> HugePages:
    """Advise `ranges` (written already) into huge pages and collapse them now."""
    advised = sum(e - s for s, e in ranges)
    if not ranges:
        return HugePages(0, 0, "no anonymous memory was added")
    madvise = _madvise()
    if madvise is None:
        return HugePages(advised, 0, "madvise is not available on this system")
    error = None
    for start, end in ranges:
        for advice, name in ((_MADV_HUGEPAGE, "MADV_HUGEPAGE"), (_MADV_COLLAPSE, "MADV_COLLAPSE")):
            if madvise(start, end - start, advice) != 0:
                code = ctypes.get_errno()
                error = f"{name}: {os.strerror(code)} ({errno.errorcode.get(code, code)})"
                break
        if error:
            break
    return HugePages(advised, huge_bytes(ranges), error)


def _madvise() -> Callable[[int, int, int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn
