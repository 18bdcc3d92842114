"""Shared fixtures. Async tests run under Trio (`trio_mode = true` in pyproject.toml)."""

from __future__ import annotations

import os

import pytest

# Keep llama.cpp from fighting the test runner for the machine's two cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Real-model tests are slower; run them after the fast ones so failures show early.
    items.sort(key=lambda item: item.get_closest_marker("model") is not None)
