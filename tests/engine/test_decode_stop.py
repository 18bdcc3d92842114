"""DecodeStop's quieting of llama.cpp's log: on while a context stops, off once released."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tributary.engine.runners.llama import decode_stop
from tributary.engine.runners.llama.decode_stop import LLAMA_LOGGER, DecodeStop


@pytest.fixture
def stop(monkeypatch: pytest.MonkeyPatch) -> Iterator[DecodeStop]:
    # No context: the abort callback is never installed, only the flag and the log level.
    monkeypatch.setattr(decode_stop.llama_cpp, "llama_set_abort_callback", lambda *a: None)
    monkeypatch.setattr(decode_stop, "_quiet", 0)
    level = LLAMA_LOGGER.level
    yield DecodeStop(None)
    LLAMA_LOGGER.setLevel(level)


def test_set_quiets_and_release_restores(stop: DecodeStop) -> None:
    LLAMA_LOGGER.setLevel(logging.ERROR)
    stop.set()
    assert stop.is_set and LLAMA_LOGGER.level == logging.CRITICAL
    stop.set()  # counted once
    stop.release()
    assert LLAMA_LOGGER.level == logging.ERROR and decode_stop._quiet == 0


def test_set_after_release_leaves_the_log_alone(stop: DecodeStop) -> None:
    LLAMA_LOGGER.setLevel(logging.ERROR)
    stop.set()
    stop.release()
    stop.set()  # a second close of the runner
    assert stop.is_set
    assert LLAMA_LOGGER.level == logging.ERROR and decode_stop._quiet == 0
