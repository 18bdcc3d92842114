"""A chat template that cannot render a plain chat stops the server at start-up, with a
message saying why, instead of a 500 (or a 400) on every chat request; one that refuses only
some chats ("System role not supported") serves, warns, and answers those with a 400.

The templates come from `--chat-template-file` (llama-server's flag) or
`EngineConfig.chat_template`, on the sim runner: no GGUF needed.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from apphelpers import running_server, sim_config

from tributary.app.chat.template_check import UnusableChatTemplate

USER = [{"role": "user", "content": "Hello"}]

#: Gemma 2's refusal, on an otherwise plain ChatML template.
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def serve(*flags: str) -> subprocess.CompletedProcess[str]:
    """`tributary serve` on the sim runner, expected to exit by itself (it is refused)."""
    command = [sys.executable, "-m", "tributary", "serve", "--runner", "sim", "--port", "0"]
    return subprocess.run(
        [*command, *flags], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_syntax_error_stops_serve_before_the_model_loads(tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }}\n{% endfor\n")
    result = serve("--chat-template-file", str(broken))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"tributary: error: the chat template of {broken} does not compile: "
        "unexpected end of template, expected 'end of statement block'. (line 3)"
    )
    assert "loading" not in result.stderr  # refused before the model loads
    assert "Tributary serving" not in result.stdout


def test_a_template_that_refuses_every_chat_stops_serve(tmp_path: Path) -> None:
    refusing = tmp_path / "tools-only.jinja"
    refusing.write_text(
        "{% if not tools %}{{ raise_exception('This model needs tools.') }}{% endif %}"
    )
    result = serve("--chat-template-file", str(refusing))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "tributary: error: the chat template of sim cannot render one user message: "
        "This model needs tools. (serve the model with a working template: "
        "--chat-template-file PATH)"
    )
    assert "Tributary serving" not in result.stdout


def test_a_missing_template_file_is_named() -> None:
    result = serve("--chat-template-file", "/nonexistent/chat.jinja")
    assert result.returncode == 2
    assert "No such file or directory: '/nonexistent/chat.jinja'" in result.stderr


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("{{ messages | no_such_filter }}", "does not compile: No filter named 'no_such_filter'."),
        ("{% no_such_tag %}", "does not compile: Encountered unknown tag 'no_such_tag'. (line 1)"),
        (
            "{{ messages[0].content + messages[0].nothing.deeper }}",
            "cannot render one user message: The model's chat template failed on these "
            "messages: 'dict object' has no attribute 'nothing'",
        ),
        (
            "{% for m in messages %}{% endfor %}",
            "cannot render one user message: it renders nothing",
        ),
    ],
    ids=["unknown-filter", "unknown-tag", "undefined", "renders-nothing"],
)
async def test_the_library_server_refuses_it_too(source: str, reason: str) -> None:
    """`open_http_server` (what `tributary serve` and embedders call) checks before listening."""
    with pytest.raises(UnusableChatTemplate) as refused:
        async with running_server(sim_config(chat_template=source)):
            pytest.fail("served a template that cannot render a chat")
    assert str(refused.value).startswith(f"the chat template of sim {reason}")


async def test_a_template_that_refuses_some_chats_serves_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tributary.chat"):
        async with running_server(sim_config(chat_template=NO_SYSTEM)) as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                body = {"messages": USER, "max_tokens": 2}
                ok = await http.post("/v1/chat/completions", json=body)
                system = [{"role": "system", "content": "Be brief."}, *USER]
                refused = await http.post("/v1/chat/completions", json={**body, "messages": system})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "System role not supported"
    warnings = [r.getMessage() for r in caplog.records if r.name == "tributary.chat"]
    assert warnings == [
        "the chat template of sim refuses a system message (such requests get a 400): "
        "System role not supported"
    ]
