"""docs/api.md's Anthropic section stays true: its examples (the official client, curl) run
against a real server with the real model, and its field table, `/openapi.json` and the
declarations name the same fields (as tests/app/test_wire_fields.py holds the other APIs)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import msgspec
import pytest
import trio
from apphelpers import Server
from test_wire_fields import DOC, SCHEMAS, declared, differences, doc_tables, refused

from tributary.app.anthropic.models import CountTokensBody, MessagesBody

pytest_plugins = ["openaifixtures"]  # model_server, http

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Anthropic Messages API"
SECTION = HEADING + (ROOT / "docs" / "api.md").read_text().split(f"\n{HEADING}")[1]
PYTHON = re.findall(r"```py\n(.*?)```", SECTION, flags=re.DOTALL)
CURL = re.findall(r"```shell\n(curl .*?)```", SECTION, flags=re.DOTALL)
DOC_URL = "http://127.0.0.1:30000"
BODIES: list[tuple[str, type[msgspec.Struct]]] = [
    ("/v1/messages", MessagesBody),
    ("/v1/messages/count_tokens", CountTokensBody),
]


def test_the_section_has_its_examples() -> None:
    assert len(PYTHON) == 1 and "import anthropic" in PYTHON[0]
    assert len(CURL) == 1


@pytest.mark.parametrize(("path", "model"), BODIES)
def test_every_field_is_in_openapi_and_the_docs(path: str, model: type[msgspec.Struct]) -> None:
    ref = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = SCHEMAS[ref["$ref"].rsplit("/", 1)[1]]
    assert differences(declared(model), set(schema["properties"]), "/openapi.json") == []
    rows = doc_tables(HEADING, "| Field |")
    assert differences(declared(MessagesBody), set(rows), f"docs/api.md ({HEADING})") == []
    for name in refused(model):
        assert schema["properties"][name]["description"].startswith("Not supported"), name
        assert "not supported" in rows[name].lower(), name


async def run(command: list[str]) -> str:
    done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return str(done.stdout.decode())


@pytest.mark.model
async def test_the_examples_run(model_server: Server, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(PYTHON[0].replace(DOC_URL, model_server.url))
    answer, streamed = (await run([sys.executable, str(script)])).strip().split("\n")
    text, _, reason = answer.rpartition(" ")
    assert "4" in text and reason in ("end_turn", "max_tokens")
    assert streamed == text  # greedy: the stream says the same

    reply = json.loads(await run(["bash", "-c", CURL[0].replace(DOC_URL, model_server.url)]))
    assert reply["type"] == "message" and reply["content"][0]["type"] == "text"
    assert reply["usage"]["output_tokens"] <= 16
