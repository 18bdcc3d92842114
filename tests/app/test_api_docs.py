"""Every `curl` example in docs/api.md runs against a real server with the real model and gets
the status the page promises (200 unless the block says `# status: N`), with a body of the
promised kind (JSON, SSE, or text)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import trio
from apphelpers import parse_sse, running_server

from tributary.app.sglang.admin import FLUSH_CACHE_MESSAGE
from tributary.engine import EngineConfig

pytestmark = pytest.mark.model

API_DOC = Path(__file__).parents[2] / "docs" / "api.md"
DOC_URL = "http://localhost:30000"
MODEL = EngineConfig(context_length=2048, max_running_requests=8, threads=1)


def curl_examples() -> list[tuple[str, int]]:
    """(command, expected status) for every ```bash block of the page."""
    examples = []
    native = API_DOC.read_text().split("\n## OpenAI-compatible API\n")[0]
    for block in re.findall(r"```bash\n(.*?)```", native, re.S):
        lines = block.strip().splitlines()
        status = 200
        command: list[str] = []
        for line in lines:
            if match := re.fullmatch(r"# status: (\d+)", line.strip()):
                status = int(match.group(1))
            elif not line.startswith("#"):
                command.append(line.rstrip("\\").strip())
        assert command and command[0].startswith("curl "), block
        examples.append((" ".join(command), status))
    return examples


def test_the_page_has_examples_for_every_endpoint() -> None:
    text = " ".join(command for command, _ in curl_examples())
    for path in [
        "/generate", "/health", "/health_generate", "/get_model_info", "/get_server_info",
        "/abort_request", "/flush_cache", "/tokenize", "/detokenize", "/get_load", "/metrics",
        "/openapi.json",
    ]:  # fmt: skip
        assert f"{DOC_URL}{path}" in text, path


async def test_curl_examples_run() -> None:
    examples = curl_examples()
    async with running_server(MODEL) as server:
        for command, expected in examples:
            # curl keeps the last -w: the status goes on its own final line.
            run = command.replace(DOC_URL, server.url) + " -w '\\n%{http_code}'"
            result = await trio.run_process(
                ["bash", "-c", run], capture_stdout=True, capture_stderr=True, check=False
            )
            assert result.returncode == 0, (command, result.stderr)
            body, _, status = result.stdout.decode().rpartition("\n")
            assert int(status) == expected, (command, body)
            check_body(body, shlex.split(command))


def check_body(body: str, argv: list[str]) -> None:
    if "-o" in argv or not body:
        return
    if body.startswith("data: "):
        events = parse_sse(body)
        assert events[-1] == "[DONE]"
    elif body[0] in "[{":
        parsed = json.loads(body)
        if isinstance(parsed, dict) and "error" in parsed:
            assert set(parsed["error"]) == {"message", "code"}
    elif body.startswith("# HELP "):  # Prometheus' text format
        assert "sglang:num_requests_total{" in body
    else:
        assert body == FLUSH_CACHE_MESSAGE
