"""The chat templates people run render exactly as Hugging Face transformers'
`apply_chat_template` renders them.

tests/fixtures/chat_templates/ holds each model's template (with where it came from) and
references.json, what transformers rendered for a fixed set of conversations
(make_references.py there says how it was made). Here Tributary's `ChatTemplate` renders the
same conversations with the same bos/eos tokens and the same clock; the text must be equal to
the character, and a conversation the template refuses must be refused with the template's own
message (the API's 400). transformers is not needed to run this.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from apphelpers import running_server

import tributary.app.chat.template as template_module
from tributary.app.chat import ChatTemplate
from tributary.app.http.errors import InvalidRequest
from tributary.engine import EngineConfig
from tributary.engine.models import MODELS, resolve_model_path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
REFERENCES = json.loads((FIXTURES / "references.json").read_text(encoding="utf-8"))
NOW = datetime.fromisoformat(REFERENCES["now"])
HEADER = re.compile(r"\A\{#.*?#\}\n", re.DOTALL)

#: The families issue 30 names; each must have a reference (a template dropped from
#: make_references.py would otherwise pass unnoticed).
FAMILIES = {
    "Llama 3.1": "llama-3.1-8b-instruct",
    "Llama 3.2": "llama-3.2-3b-instruct",
    "Qwen 2.5": "qwen2.5-7b-instruct",
    "Qwen 3": "qwen3-0.6b",
    "Gemma 3": "gemma-3-it",
    "Mistral": "mistral-nemo-instruct-2407",
    "Phi-3": "phi-3.5-mini-instruct",
    "Phi-4": "phi-4",
    "SmolLM2": "smollm2-135m-instruct",
}

CASES = [
    pytest.param(model, case, id=f"{model}-{case['name']}")
    for model, spec in REFERENCES["models"].items()
    for case in spec["cases"]
]


class _FixedClock(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _FixedClock:
        return cls.fromisoformat(NOW.isoformat())


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3.2 and Mistral Small 3.2 print today's date (`strftime_now`); the references
    were rendered at NOW."""
    monkeypatch.setattr(template_module, "datetime", _FixedClock)


def load_template(model: str) -> ChatTemplate:
    spec = REFERENCES["models"][model]
    text = (FIXTURES / spec["template"]).read_text(encoding="utf-8")
    header = HEADER.match(text)
    assert header, f"{spec['template']} has no source header"
    return ChatTemplate(
        text[header.end() :],
        bos_token=spec["bos_token"] or "",
        eos_token=spec["eos_token"] or "",
    )


def test_every_family_has_references() -> None:
    for family, model in FAMILIES.items():
        cases = REFERENCES["models"].get(model, {}).get("cases", [])
        assert len(cases) >= 10, family
        # Only a conversation whose roles do not alternate may be refused.
        refused = {c["name"] for c in cases if "error" in c}
        assert refused <= {"roles_not_alternating", "assistant_first"}, family


def assert_renders_as_transformers(render: Callable[[], str], reference: dict[str, Any]) -> None:
    """`render()` gives the reference's text, or refuses as transformers did: with the
    template's own words when it called raise_exception, else naming jinja's error."""
    if "error" not in reference:
        assert render() == reference["text"]
        return
    with pytest.raises(InvalidRequest) as refused:
        render()
    if reference["raised"]:
        assert str(refused.value) == reference["error"]
    else:
        assert str(refused.value) == (
            f"The model's chat template failed on these messages: {reference['error']}"
        )
    assert refused.value.param == "messages"


@pytest.mark.parametrize(("model", "case"), CASES)
def test_renders_as_transformers(model: str, case: dict[str, Any]) -> None:
    template = load_template(model)
    assert_renders_as_transformers(
        lambda: template.render(
            case["messages"], add_generation_prompt=case["add_generation_prompt"]
        ),
        case,
    )


@pytest.mark.parametrize("probe", sorted(REFERENCES["probes"]))
def test_jinja_environment_is_transformers(probe: str) -> None:
    """One feature of transformers' jinja environment a probe: the variables it defines
    (`tools` and `documents` as None), its `tojson`, `{% generation %}`, loop controls,
    namespace, string methods, whitespace control, undefined values, the sandbox."""
    reference = REFERENCES["probes"][probe]
    tokens = REFERENCES["probe_tokens"]
    template = ChatTemplate(
        reference["template"], bos_token=tokens["bos_token"], eos_token=tokens["eos_token"]
    )
    assert_renders_as_transformers(
        lambda: template.render(REFERENCES["probe_messages"], add_generation_prompt=True),
        reference,
    )


def test_served_models_use_the_tested_templates() -> None:
    """The templates of the models Tributary serves by name are the tested ones: SmolLM2's is
    in its GGUF; Gemma 3 270M's GGUF has none, so Tributary serves Gemma 3's own (models.py)."""
    smollm2 = resolve_model_path("smollm2-135m")
    with smollm2.open("rb") as gguf:
        head = gguf.read(4_000_000)
    assert load_template("smollm2-135m-instruct").source.encode() in head
    assert MODELS["gemma3-270m"].chat_template == load_template("gemma-3-it").source


SERVED = [("smollm2-135m", "smollm2-135m-instruct"), ("gemma3-270m", "gemma-3-it")]


@pytest.mark.model
@pytest.mark.parametrize(("name", "fixture"), SERVED)
async def test_served_models_prompt_as_transformers(name: str, fixture: str) -> None:
    """Over the wire, as a chat request gets it: the prompt the server builds (`/tokenize`
    with `messages` gives the ids `/v1/chat/completions` runs) is transformers' render,
    tokenized, with the BOS/EOS texts Tributary takes from the GGUF; a refused conversation
    is a 400 with the template's words."""
    config = EngineConfig(
        model_path=name, context_length=512, max_running_requests=1, mmap_weights=True
    )
    spec = REFERENCES["models"][fixture]
    async with running_server(config) as server:
        template = ChatTemplate.for_engine(server.eng)
        assert template is not None
        assert (template.bos_token, template.eos_token) == (spec["bos_token"], spec["eos_token"])
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            for case in spec["cases"]:
                body = {k: case[k] for k in ("messages", "add_generation_prompt")}
                answer = await http.post("/tokenize", json=body)
                if "error" in case:
                    assert answer.status_code == 400, case["name"]
                    assert answer.json()["message"] == case["error"], case["name"]  # SGLang's
                    continue
                expected = server.eng.tokenize(case["text"], add_special=False)
                assert answer.json()["tokens"] == expected, case["name"]
