"""The chat prompt is exactly what the GGUF's template specifies, rendered as llama-cpp-python
renders it, and it is what the server feeds the model."""

from __future__ import annotations

import httpx
import pytest
from apphelpers import Server
from jinja2.sandbox import ImmutableSandboxedEnvironment
from openaihelpers import chat_prompt_is

from tributary.app.chat import ChatTemplate
from tributary.app.http.errors import InvalidRequest

pytest_plugins = ["openaifixtures"]  # model_server, http, aclient

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]


def render_independently(source: str, messages: list[dict[str, str]], **tokens: str) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source).render(messages=messages, add_generation_prompt=True, **tokens)


@pytest.mark.model
async def test_two_turn_prompt_is_the_gguf_template(
    http: httpx.AsyncClient, model_server: Server
) -> None:
    eng = model_server.eng
    source = eng.model_info.chat_template
    assert source and "<|im_start|>" in source
    expected = render_independently(
        source, CONVERSATION, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    # What SmolLM2's template says, spelled out: a default system turn, then the turns.
    assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert expected.endswith(
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    template = ChatTemplate.for_engine(eng)
    assert template is not None
    assert template.render(CONVERSATION) == expected

    # The server's prompt is those tokens: same count, and the same greedy continuation as
    # /v1/completions given exactly those token ids.
    expected_ids = eng.tokenize(expected, add_special=False)
    assert expected_ids.count(eng.model_info.bos_token_id) == 5  # one <|im_start|> per turn
    assert await chat_prompt_is(http, model_server, CONVERSATION, expected_ids)


def test_environment_matches_llama_cpp_python() -> None:
    source = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endgeneration %}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    messages = [
        {"role": "system", "content": "é"},
        {"role": "user", "content": "hi"},
        {"role": "user", "content": "dropped by break"},
    ]
    assert template.render(messages) == '<s>[system]"é"[user]"hi"[assistant]</s>'
    assert template.render(messages, add_generation_prompt=False) == '<s>[system]"é"[user]"hi"</s>'


def test_trim_and_lstrip_blocks() -> None:
    source = "{% for m in messages %}\n    {{ m['content'] }}\n{% endfor %}"
    template = ChatTemplate(source, bos_token="", eos_token="")
    assert template.render([{"role": "user", "content": "a"}]) == "    a\n"


def test_template_exceptions_are_bad_requests() -> None:
    source = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match="System role not supported") as info:
        template.render([{"role": "system", "content": "x"}])
    assert info.value.http_status == 400
    # The sandbox refuses attribute access to internals instead of running it.
    sneaky = ChatTemplate("{{ messages.__class__.__mro__ }}", bos_token="", eos_token="")
    with pytest.raises(InvalidRequest, match="chat template failed"):
        sneaky.render([])
