"""Run every Python example in docs/embedding.md, so the page stays true."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)

pytestmark = pytest.mark.model


def test_the_page_has_examples() -> None:
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("source", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_example_runs(source: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(source)
    root = DOC.parent.parent
    done = subprocess.run(
        [sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "every example prints what it did"
    if "finish reason" in source:
        assert "Paris" in done.stdout and "'type': 'length'" in done.stdout
    if "/generate" in source:
        _text, latency = done.stdout.strip().rsplit(" ", 1)
        assert float(latency) > 0
