"""Run the examples in the OpenAI section of docs/api.md (the official client and the curl
commands) against a real server, so the page stays true."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import trio
from apphelpers import Server, parse_sse

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
# The OpenAI section of the API reference, to the end of the page.
DOC = (
    "## OpenAI-compatible API\n"
    + (ROOT / "docs" / "api.md").read_text().split("\n## OpenAI-compatible API\n")[1]
)
PYTHON = re.findall(r"```python\n(.*?)```", DOC, flags=re.DOTALL)
CURL = re.findall(r"```bash\n(curl .*?)```", DOC, flags=re.DOTALL)
DOC_URL = "http://127.0.0.1:30000"


def test_the_page_has_its_examples() -> None:
    assert DOC.startswith("## OpenAI-compatible API\n")
    assert len(PYTHON) == 1 and "from openai import OpenAI" in PYTHON[0]
    assert len(CURL) == 2


async def run(command: list[str]) -> str:
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return str(done.stdout.decode())


async def test_official_client_example(model_server: Server, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(PYTHON[0].replace(DOC_URL, model_server.url))
    out = await run([sys.executable, str(script)])
    answer, usage, streamed, total = out.strip().split("\n")
    assert "4" in answer and streamed == answer  # greedy: the stream says the same
    prompt_tokens, completion_tokens = map(int, usage.removeprefix("usage: ").split())
    assert total == f"total tokens: {prompt_tokens + completion_tokens}"


async def test_curl_examples(model_server: Server) -> None:
    completion = json.loads(await run(["bash", "-c", CURL[0].replace(DOC_URL, model_server.url)]))
    texts = [c["text"] for c in completion["choices"]]
    assert "Paris" in texts[0] and "4" in texts[1]
    assert completion["usage"]["completion_tokens"] <= 16

    events = parse_sse(await run(["bash", "-c", CURL[1].replace(DOC_URL, model_server.url)]))
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert "4" in content
    assert events[-2]["choices"] == [] and events[-2]["usage"]["total_tokens"] > 0
