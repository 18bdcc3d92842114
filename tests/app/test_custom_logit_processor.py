"""SGLang's `custom_logit_processor` against `tributary serve --enable-custom-logit-processor`
in a subprocess, with payloads built exactly as an SGLang client builds them.

The test process plays the client: it registers a stand-in for
`sglang.srt.sampling.custom_logit_processor` (SGLang's `CustomLogitProcessor` with its
`to_str`), defines processors in a fresh `__main__` namespace so dill pickles them by value
(as it does for a script's classes), and sends `Processor.to_str()`. The server runs in its
own process, which has no `sglang` module: it must map SGLang's module to its own, as a real
deployment would (/tmp/research/sglang_compat.md section 4, contract item 10)."""

from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import sys
import textwrap
import types
from collections.abc import AsyncIterator, Iterator
from typing import Any

import dill
import httpx
import pytest
import trio
from apphelpers import running_server
from sglangfixtures import MODEL, generate, sglang_post, stream_frames

pytestmark = pytest.mark.model

SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"

#: SGLang's module, as much of it as a client's pickles reference (0.5.23's source for
#: these classes, minus the torch import: the client side never calls them).
SGLANG_SOURCE = """
import json
from abc import ABC, abstractmethod

import dill


class CustomLogitProcessor(ABC):
    @abstractmethod
    def __call__(self, logits, custom_param_list=None):
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        return json.dumps({"callable": dill.dumps(cls).hex()})


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        disallowed_token_ids = custom_param_list[0]["token_ids"]
        assert all(disallowed_token_ids == c["token_ids"] for c in custom_param_list)
        logits[..., disallowed_token_ids] = -float("inf")
        return logits
"""

#: Client-side processors, as SGLang's test_srt_endpoint.py writes them.
CLIENT_SOURCE = """
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class DeterministicLogitProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list):
        assert logits.shape[0] == len(custom_param_list)
        key = "token_id"

        for i, param_dict in enumerate(custom_param_list):
            # Mask all other tokens
            logits[i, :] = -float("inf")
            # Assign highest probability to the specified token
            logits[i, param_dict[key]] = 0.0
        return logits


class DeterministicStatefulLogitProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list):
        assert logits.shape[0] == len(custom_param_list)

        for i, param_dict in enumerate(custom_param_list):
            if param_dict["delay"] > 0:
                param_dict["delay"] -= 1
                continue
            if param_dict["delay"] == 0:
                param_dict["delay"] -= 1
                force_token = param_dict["token_id"]
            else:
                output_ids = param_dict["__req__"].output_ids
                force_token = output_ids[-1] + 1
            # Mask all other tokens
            logits[i, :] = -float("inf")
            # Assign highest probability to the specified token
            logits[i, force_token] = 0.0
        return logits


class EchoPromptProcessor(CustomLogitProcessor):
    # Reads the request through __req__: the prompt, and how far the output has got.
    def __call__(self, logits, custom_param_list):
        for i, params in enumerate(custom_param_list):
            req = params["__req__"]
            logits[i, :] = -float("inf")
            logits[i, req.origin_input_ids[len(req.output_ids)]] = 0.0
        return logits


class NoParamsProcessor(CustomLogitProcessor):
    # Without custom_params a row gets None (and no __req__).
    def __call__(self, logits, custom_param_list):
        assert custom_param_list == [None], custom_param_list
        logits[0, :] = -float("inf")
        logits[0, 7042] = 0.0
        return logits


class FailingProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list):
        for params in custom_param_list:
            params["calls"] = params.get("calls", 0) + 1
            if params["calls"] > params["fail_after"]:
                raise ValueError("processor exploded on purpose")
        return logits


class WrongShapeProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list):
        return logits[:, :10]


class AbstractStill(CustomLogitProcessor):
    pass
"""


@pytest.fixture(scope="module")
def sglang_client() -> Iterator[types.SimpleNamespace]:
    """The client side: SGLang's module registered in sys.modules (with its parent
    packages), and the client's processors defined in a namespace named __main__."""
    names = SGLANG_MODULE.split(".")
    saved = {n: sys.modules.get(n) for n in (".".join(names[: i + 1]) for i in range(len(names)))}
    modules = []
    for i in range(len(names)):
        module = types.ModuleType(".".join(names[: i + 1]))
        if i < len(names) - 1:
            module.__path__ = []
        sys.modules[module.__name__] = module
        if modules:
            setattr(modules[-1], names[i], module)
        modules.append(module)
    sglang = modules[-1]
    exec(compile(textwrap.dedent(SGLANG_SOURCE), SGLANG_MODULE, "exec"), sglang.__dict__)
    client: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(textwrap.dedent(CLIENT_SOURCE), "<client script>", "exec"), client)
    try:
        yield types.SimpleNamespace(sglang=sglang, **client)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def pickled_globals(payload: str) -> list[tuple[str, str]]:
    """The (module, name) pairs a payload's pickle imports when it is loaded."""
    raw = bytes.fromhex(json.loads(payload)["callable"])
    seen: list[tuple[str, str]] = []

    class Recorder(dill.Unpickler):  # type: ignore[misc]
        def find_class(self, module: str, name: str) -> Any:
            seen.append((module, name))
            return super().find_class(module, name)

    Recorder(io.BytesIO(raw)).load()
    return seen


STARTUP = re.compile(r"Tributary serving .* at (http://\S+)")


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """`tributary serve --enable-custom-logit-processor` on the real model, in a process of
    its own (which has no `sglang` module). Shared by this module's tests."""
    command = [
        sys.executable, "-m", "tributary", "serve", "--port", "0", "--threads", "1",
        "--context-length", "2048", "--max-running-requests", "16",
        "--enable-custom-logit-processor", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = STARTUP.search(line)
        assert match, line
        yield match.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


@pytest.fixture
async def client(server_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server_url, timeout=120) as c:
        yield c


PROMPT = "Question: Is Paris the Capital of France? Answer:"


def forced(payload: str, token_id: int | None, **sampling: Any) -> dict[str, Any]:
    """SGLang's `run_custom_logit_processor` body (with a short max_new_tokens); without a
    token id, the plain request it mixes in."""
    body: dict[str, Any] = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, **sampling},
        "return_logprob": True,
    }
    if token_id is not None:
        body["custom_logit_processor"] = payload
        body["sampling_params"]["custom_params"] = {"token_id": token_id}
    return body


def test_payload_is_what_an_sglang_client_sends(sglang_client: types.SimpleNamespace) -> None:
    payload = sglang_client.DeterministicLogitProcessor.to_str()
    assert list(json.loads(payload)) == ["callable"]
    imported = pickled_globals(payload)
    # The class itself travels by value; its base is SGLang's, by reference.
    assert (SGLANG_MODULE, "CustomLogitProcessor") in imported
    assert not [g for g in imported if g[1] == "DeterministicLogitProcessor"]
    assert not [g for g in imported if g[0] == "__main__"]
    # SGLang's own processor is pickled by reference only.
    builtin = sglang_client.sglang.DisallowedTokensLogitsProcessor.to_str()
    assert pickled_globals(builtin) == [(SGLANG_MODULE, "DisallowedTokensLogitsProcessor")]
    # An instance's to_str pickles the class, as SGLang's stateful test calls it.
    assert sglang_client.DeterministicLogitProcessor().to_str() == payload


async def test_10_every_output_token_is_the_forced_one(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    payload = sglang_client.DeterministicLogitProcessor.to_str()
    paris = 7042  # " Paris": a token with text, so the text shows it too
    for temperature in (0.0, 1.0):
        for token_id in (5, paris):
            body = forced(payload, token_id, temperature=temperature)
            obj = await generate(client, body)
            otl = obj["meta_info"]["output_token_logprobs"]
            assert all(x[1] == token_id for x in otl), otl
            assert obj["output_ids"] == [token_id] * 8
            # All the probability is on the forced token, as the processor left it.
            assert all(x[0] == 0.0 for x in otl)
            if token_id == paris:
                assert obj["text"] == " Paris" * 8


async def test_10_mixed_concurrent_requests_each_get_only_their_own_tokens(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    payload = sglang_client.DeterministicLogitProcessor.to_str()
    # 0 and 2 are EOS tokens: forcing one ends the request at its first token.
    targets: list[int | None] = [0, 2, 5, 30, 198, 7042, 4649, 1000, None, None, None, None]
    plain = await generate(client, forced(payload, None))
    results: dict[int, dict[str, Any]] = {}

    async def run(i: int) -> None:
        results[i] = await generate(client, forced(payload, targets[i]))

    async with trio.open_nursery() as nursery:
        for i in [3, 8, 0, 11, 5, 1, 9, 7, 2, 10, 6, 4]:  # shuffled
            nursery.start_soon(run, i)
    for i, target in enumerate(targets):
        obj = results[i]
        sampled = [x[1] for x in obj["meta_info"]["output_token_logprobs"]]
        if target is None:
            assert obj["output_ids"] == plain["output_ids"]  # untouched by the others'
            assert obj["text"] == plain["text"]
        elif target in (0, 2):
            assert sampled == [target] == obj["output_ids"]
            assert obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}
        else:
            assert sampled == [target] * 8 == obj["output_ids"]

    # One batch body: a list of processors, null where a prompt has none.
    batch = {
        "text": [PROMPT] * 4,
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 4, "custom_params": {"token_id": 11}},
            {"temperature": 0, "max_new_tokens": 4},
            {"temperature": 0, "max_new_tokens": 4, "custom_params": {"token_id": 12}},
            {"temperature": 0, "max_new_tokens": 4},
        ],
        "custom_logit_processor": [payload, None, payload, None],
    }
    first, second, third, fourth = await generate(client, batch)
    assert first["output_ids"] == [11] * 4 and third["output_ids"] == [12] * 4
    assert second["output_ids"] == fourth["output_ids"] == plain["output_ids"][:4]
    frames = await stream_frames(client, batch)
    finals = {f["index"]: f for f in frames if f["meta_info"]["finish_reason"] is not None}
    assert finals[0]["output_ids"] == [11] * 4 and finals[2]["output_ids"] == [12] * 4
    assert finals[1]["output_ids"] == plain["output_ids"][:4]


async def test_sglangs_builtin_disallowed_tokens_processor(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    plain = await generate(client, forced("", None, max_new_tokens=12))
    banned = sorted(set(plain["output_ids"][:3]))
    body = {
        "text": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 12,
            "custom_params": {"token_ids": banned},
        },
        "custom_logit_processor": sglang_client.sglang.DisallowedTokensLogitsProcessor.to_str(),
        "return_logprob": True,
        "top_logprobs_num": 5,
    }
    obj = await generate(client, body)
    assert obj["output_ids"] != plain["output_ids"]
    assert not set(obj["output_ids"]) & set(banned)
    for top in obj["meta_info"]["output_top_logprobs"]:
        assert not {x[1] for x in top} & set(banned)  # gone from the distribution too


async def test_req_is_visible_to_stateful_processors(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    plain = await generate(client, forced("", None, max_new_tokens=10))
    # SGLang's stateful test: `delay` tokens as usual, then token_id, then each token one
    # more than the last of `__req__.output_ids` (so the dict persists from call to call).
    body = {
        "text": PROMPT,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": 10,
            "custom_params": {"token_id": 5, "delay": 2},
        },
        "return_logprob": True,
        "custom_logit_processor": sglang_client.DeterministicStatefulLogitProcessor().to_str(),
    }
    obj = await generate(client, body)
    sampled = [x[1] for x in obj["meta_info"]["output_token_logprobs"]]
    assert sampled[:2] == plain["output_ids"][:2]
    assert sampled[2:] == [5 + k for k in range(8)]

    # origin_input_ids too: a processor that copies the prompt, token by token.
    echo = {
        "text": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": 6, "custom_params": {}},
        "custom_logit_processor": sglang_client.EchoPromptProcessor.to_str(),
    }
    scored = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    prompt_ids = [
        x[1] for x in (await generate(client, scored))["meta_info"]["input_token_logprobs"]
    ]
    assert (await generate(client, echo))["output_ids"] == prompt_ids[:6]

    # No custom_params: the processor sees None for the row.
    bare = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 3},
        "custom_logit_processor": sglang_client.NoParamsProcessor.to_str(),
    }
    assert (await generate(client, bare))["output_ids"] == [7042] * 3


async def test_a_failing_processor_fails_only_its_own_request(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    plain_body = forced("", None, max_new_tokens=24)
    plain = await generate(client, plain_body)
    failing = {
        "text": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 24,
            "custom_params": {"fail_after": 3},
        },
        "custom_logit_processor": sglang_client.FailingProcessor.to_str(),
    }
    responses: dict[str, httpx.Response] = {}

    async def run(name: str, body: dict[str, Any]) -> None:
        responses[name] = await sglang_post(client, body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "plain", plain_body)
        nursery.start_soon(run, "failing", failing)
        nursery.start_soon(run, "failing-stream", {**failing, "stream": True})
    assert responses["plain"].status_code == 200
    assert responses["plain"].json()["output_ids"] == plain["output_ids"]
    bad = responses["failing"]
    assert bad.status_code == 400, bad.text
    message = bad.json()["error"]["message"]
    assert "custom_logit_processor" in message and "processor exploded on purpose" in message
    # A stream had started: the output so far, then an error item, then [DONE].
    stream = responses["failing-stream"]
    assert stream.status_code == 200
    events = stream.text.strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: ") :])
    assert "processor exploded on purpose" in last["error"]["message"]

    wrong_shape = {
        "text": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        "custom_logit_processor": sglang_client.WrongShapeProcessor.to_str(),
    }
    response = await sglang_post(client, wrong_shape)
    assert response.status_code == 400
    assert "shape" in response.json()["error"]["message"]
    assert (await generate(client, plain_body))["output_ids"] == plain["output_ids"]


def unloadable_payload() -> str:
    """A class pickled by reference to a module only the client has."""
    module = types.ModuleType("client_only_processors")
    exec("class Processor:\n    def __call__(self, logits, params):\n        return logits\n",
         module.__dict__)  # fmt: skip
    sys.modules[module.__name__] = module
    try:
        return json.dumps({"callable": dill.dumps(module.Processor).hex()})
    finally:
        del sys.modules[module.__name__]


async def test_malformed_payloads_are_400(
    client: httpx.AsyncClient, sglang_client: types.SimpleNamespace
) -> None:
    cases = [
        ("not json", "custom_logit_processor"),
        (json.dumps({"something": "else"}), "callable"),
        (json.dumps({"callable": "zz-not-hex"}), "custom_logit_processor"),
        (json.dumps({"callable": "00ff00ff"}), "could not be loaded"),
        (json.dumps({"callable": dill.dumps(42).hex()}), "pickled processor class"),
        (unloadable_payload(), "client_only_processors"),
        (sglang_client.AbstractStill.to_str(), "could not be instantiated"),
        (5, "custom_logit_processor must be a string"),
    ]
    for payload, needle in cases:
        body = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 4},
            "custom_logit_processor": payload,
        }
        response = await sglang_post(client, body)
        assert response.status_code == 400, (payload, response.text)
        assert needle in response.json()["error"]["message"], (payload, response.text)
    ok = await generate(client, forced(sglang_client.DeterministicLogitProcessor.to_str(), 5))
    assert ok["output_ids"] == [5] * 8


async def test_refused_without_the_flag(sglang_client: types.SimpleNamespace) -> None:
    message = (
        "The server is not configured to enable custom logit processor. Please set "
        "`--enable-custom-logit-processor` to enable this feature."
    )
    payload = sglang_client.DeterministicLogitProcessor.to_str()
    async with running_server(MODEL) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for body in (
                forced(payload, 5),
                {**forced(payload, 5), "stream": True},
                {
                    "text": [PROMPT, PROMPT],
                    "sampling_params": {"max_new_tokens": 2},
                    "custom_logit_processor": [None, payload],
                },
            ):
                response = await sglang_post(client, body)
                assert response.status_code == 400, response.text
                assert response.json()["error"]["message"] == message
            assert server.eng.stats().generated_tokens == 0
            ok = await generate(client, forced(payload, None))
            assert ok["meta_info"]["completion_tokens"] == 8
