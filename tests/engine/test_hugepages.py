"""Finding the memory a model load added, and moving it into huge pages
(engine/runners/hugepages.py), on memory of the test's own."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest

from tributary.engine.runners.hugepages import (
    HUGE_PAGE,
    anonymous_ranges,
    back_with_huge_pages,
    collapse_available,
    fresh_ranges,
    huge_bytes,
)

MIB = 1 << 20


def test_fresh_ranges_keep_only_new_memory_in_whole_huge_pages() -> None:
    old = (10 * HUGE_PAGE, 12 * HUGE_PAGE)
    # A new mapping merged into the old one's end, another on its own and unaligned, and
    # one too small to hold a whole huge page.
    after = [
        (10 * HUGE_PAGE, 20 * HUGE_PAGE),
        (30 * HUGE_PAGE + 4096, 34 * HUGE_PAGE + 8192),
        (40 * HUGE_PAGE + 4096, 41 * HUGE_PAGE + 4096),
    ]
    assert fresh_ranges([old], after) == [
        (12 * HUGE_PAGE, 20 * HUGE_PAGE),
        (31 * HUGE_PAGE, 34 * HUGE_PAGE),
    ]
    # Old memory on both sides of new: only the middle is fresh.
    both = [(0, HUGE_PAGE), (5 * HUGE_PAGE, 6 * HUGE_PAGE)]
    assert fresh_ranges(both, [(0, 6 * HUGE_PAGE)]) == [(HUGE_PAGE, 5 * HUGE_PAGE)]
    assert fresh_ranges(after, after) == []


def test_anonymous_ranges_skip_files_heap_and_read_only_memory(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "00400000-00452000 r-xp 00000000 08:02 173521 /usr/bin/python3\n"
        "01000000-03000000 rw-p 00000000 00:00 0 [heap]\n"
        "7f0000000000-7f0006000000 rw-p 00000000 00:00 0\n"
        "7f0010000000-7f0010200000 r--p 00000000 00:00 0\n"
        "7f0020000000-7f0020400000 rw-s 00000000 00:01 42 /dev/zero (deleted)\n"
    )
    assert anonymous_ranges(maps) == [(0x7F0000000000, 0x7F0006000000)]
    assert anonymous_ranges(tmp_path / "missing") == []


def test_huge_bytes_counts_only_mappings_inside_the_ranges(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\n"
        "Size:               4096 kB\n"
        "AnonHugePages:      4096 kB\n"
        "7f0000400000-7f0000800000 rw-p 00000000 00:00 0\n"
        "AnonHugePages:      2048 kB\n"
    )
    assert huge_bytes([(0x7F0000000000, 0x7F0000400000)], smaps) == 4 * MIB
    assert huge_bytes([(0x7F0000000000, 0x7F0000800000)], smaps) == 6 * MIB
    assert huge_bytes([(0x7F0000100000, 0x7F0000400000)], smaps) == 0
    # Two neighbouring ranges that the kernel made one mapping.
    halves = [(0x7F0000000000, 0x7F0000200000), (0x7F0000200000, 0x7F0000400000)]
    assert huge_bytes(halves, smaps) == 4 * MIB


THP = pytest.mark.skipif(
    not collapse_available(), reason="this kernel does not collapse memory into huge pages"
)


def written(size: int) -> mmap.mmap:
    """Private anonymous memory, as glibc serves llama.cpp's weight buffer, written in 4 KiB
    pages (as a read of the GGUF writes it, whatever the kernel's THP default)."""
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    memory.write(b"\x01" * size)
    return memory


@THP
def test_memory_written_in_small_pages_is_collapsed_into_huge_pages() -> None:
    before = anonymous_ranges()
    memory = written(16 * MIB)
    try:
        ranges = fresh_ranges(before, anonymous_ranges())
        assert sum(e - s for s, e in ranges) >= 14 * MIB
        assert huge_bytes(ranges) == 0
        pages = back_with_huge_pages(ranges, expected=16 * MIB)
        assert pages.error is None, pages.error
        assert pages.huge >= 14 * MIB
        memory.seek(0)
        assert memory.read() == b"\x01" * len(memory)  # the contents moved with the pages
    finally:
        memory.close()


@THP
def test_memory_another_thread_mapped_and_never_wrote_does_not_keep_the_weights_small() -> None:
    """The kernel refuses to collapse a region never written (EINVAL); one mapped during the
    load is among the fresh ranges, often just below the weights."""
    before = anonymous_ranges()
    weights = written(16 * MIB)
    other = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        ranges = fresh_ranges(before, anonymous_ranges())
        address = ctypes.addressof(ctypes.c_char.from_buffer(other))
        assert any(s <= address < e for s, e in ranges)  # advised with the weights
        pages = back_with_huge_pages(ranges, expected=16 * MIB)
        assert pages.error is None, pages.error
        assert 14 * MIB <= pages.huge < 32 * MIB  # the weights, not the untouched memory
    finally:
        weights.close()
        other.close()


def test_nothing_new_is_reported_not_advised() -> None:
    pages = back_with_huge_pages([], expected=64 * MIB)
    assert pages.advised == pages.huge == 0 and pages.error
