"""Run every example in docs/testing.md: each Python block is a test module, run by pytest in a
project of its own whose configuration is the page's TOML block. The plugin comes from the
installed `pytest11` entry point, as it does for a user."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"
TEXT = DOC.read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", TEXT, flags=re.DOTALL)
CONFIGS = re.findall(r"```toml\n(.*?)```", TEXT, flags=re.DOTALL)


def test_the_page_has_examples_and_a_config() -> None:
    assert len(EXAMPLES) >= 5
    assert len(CONFIGS) == 1 and "trio_mode = true" in CONFIGS[0]


def test_every_example_passes(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text(CONFIGS[0])
    modules = []
    for i, source in enumerate(EXAMPLES):
        module = tmp_path / f"test_example{i}.py"
        module.write_text(source)
        modules.append(module.stem)
    report = tmp_path / "report.xml"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-2000:]
    cases = ET.parse(report).getroot().iter("testcase")
    passed: dict[str, int] = {}
    for case in cases:
        outcome = [child.tag for child in case]  # failure, error, skipped: anything but a pass
        assert not outcome, f"{case.get('name')}: {outcome}"
        module = case.get("classname", "").split(".")[-1]
        passed[module] = passed.get(module, 0) + 1
    # Every block ran, and ran every test it defines.
    for module, source in zip(modules, EXAMPLES, strict=True):
        defined = len(re.findall(r"^async def test_|^def test_", source, flags=re.MULTILINE))
        assert passed.get(module, 0) >= defined >= 1, (module, passed)
