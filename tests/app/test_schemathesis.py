"""schemathesis against a live server, driven by the server's own `/openapi.json`: every
operation gets generated requests (valid and invalid ones, by the schema), and every answer
must be no 5xx, with a documented status, content type and body schema.

The server is a real Hypercorn on a free port over the zero-cost sim model (fuzzing.py);
schemathesis runs as its CLI in a subprocess, with a fixed seed and a bounded number of
examples per operation (TRIBUTARY_SCHEMATHESIS_EXAMPLES, 20 by default).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import trio
from fuzzing import FUZZ_ENGINE, fuzz_runner

from tributary.engine import open_engine
from tributary.testing import open_server, wait_engine_idle

EXAMPLES = int(os.environ.get("TRIBUTARY_SCHEMATHESIS_EXAMPLES", "20"))
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
]


async def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path: Path) -> None:
    cli = Path(sys.executable).with_name("schemathesis")
    async with open_engine(FUZZ_ENGINE, runner=fuzz_runner()) as engine:
        async with open_server(engine=engine) as server:
            result = await _run(cli, server.url, tmp_path)
            output = result.stdout.decode(errors="replace")
            assert result.returncode == 0, output[-6000:]
            cases = re.search(r"(\d+) generated, (\d+) passed", output)
            assert cases and cases.group(1) == cases.group(2), output[-3000:]
            assert int(cases.group(1)) >= 19 * EXAMPLES  # every operation ran
            print(f"schemathesis: {cases.group(1)} cases, all passed")
            async with httpx.AsyncClient(base_url=server.url) as client:
                assert (await client.get("/health")).status_code == 200
            await wait_engine_idle(engine)


async def _run(cli: Path, url: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [
            str(cli), "run", f"{url}/openapi.json",
            "--checks", ",".join(CHECKS),
            "--max-examples", str(EXAMPLES),
            "--seed", "1",
            "--workers", "1",
            "--request-timeout", "30",
            "--no-color",
        ],
        cwd=cwd,
        capture_stdout=True,
        stderr=subprocess.STDOUT,
        check=False,
    )  # fmt: skip
