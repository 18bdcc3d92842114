"""Hypothesis strategies for hostile request bodies, and a server in a thread of its own that
synchronous Hypothesis tests can drive (tests/app/test_fuzz.py).

Bodies are bytes, not objects. Two in three are nearly valid (a valid request but for up to
two fields holding anything), so they reach the engine; one in three lets every known field
(every sampling field included) hold values of any type, edge numbers, huge strings, and adds
unknown keys. NaN and Infinity are written as the bare literals JSON lacks; one body in four
is then corrupted in ways a JSON encoder cannot produce (invalid UTF-8, an unpaired surrogate
escape, nesting deeper than a parser's stack, a cut body, not JSON at all).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import trio
from apphelpers import chat_sim_runner
from hypothesis import strategies as st

from tributary.app import create_app, open_http_server
from tributary.engine import Engine, SimLatency, open_engine
from tributary.engine.runners.sim import SimRunner
from tributary.testing import AppClient, server_settings, sim_config

T = TypeVar("T")

#: Hypothesis examples per endpoint for the in-memory pass; the real-socket pass runs a
#: quarter as many. TRIBUTARY_FUZZ_EXAMPLES=5000 runs more locally.
EXAMPLES = int(os.environ.get("TRIBUTARY_FUZZ_EXAMPLES", "150"))

#: Steps cost no time: a fuzzed request that is valid runs to its end at once. A small
#: context and queue bound the work a valid body can ask for.
FUZZ_ENGINE = sim_config(
    context_length=256,
    max_queued_requests=8,
    sim_latency=SimLatency(step_base=0.0, decode_per_seq=0.0, prefill_per_token=0.0),
)

SAMPLING_FIELDS = [
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
    "stop_regex", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "n", "stream_interval", "logit_bias", "sampling_seed", "custom_params",
    "regex", "json_schema", "ebnf", "structural_tag",
]  # fmt: skip

GENERATE_FIELDS = [
    "text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
    "custom_logit_processor", "input_embeds", "image_data", "lora_path", "session_params",
    "return_hidden_states",
]  # fmt: skip

OPENAI_FIELDS = [
    "model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "stop_regex",
    "logit_bias", "seed", "min_tokens", "ignore_eos", "skip_special_tokens", "no_stop_trim",
    "spaces_between_special_tokens", "regex", "ebnf", "json_schema", "response_format",
    "stream", "stream_options", "user", "rid", "custom_params", "custom_logit_processor",
    "lora_path", "structural_tag",
]  # fmt: skip

COMPLETION_FIELDS = [*OPENAI_FIELDS, "prompt", "echo", "logprobs", "suffix", "best_of"]
CHAT_FIELDS = [
    *OPENAI_FIELDS, "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
    "tool_choice", "functions", "function_call", "audio", "modalities", "prediction",
]  # fmt: skip
ABORT_FIELDS = ["rid", "abort_all"]
#: The rid of the batch that runs beside every fuzzed /abort_request (test_fuzz.py).
VICTIM = "victim"

# Placeholders the encoder replaces by literals JSON does not have.
_NAN, _INF, _NEG_INF = "\x00NaN\x00", "\x00Inf\x00", "\x00-Inf\x00"

# -- values of any type --------------------------------------------------------------------------

edge_ints = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63, -(2**63), 10**30]),
    st.integers(),
)
edge_floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-300, 1e308, -1e308, 0.5, 1.0, 2.0, 1e30, 1e31]),
    st.sampled_from([_NAN, _INF, _NEG_INF]),
)
strings = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "hi", "\u0000", "é", "😀", "<|im_end|>", "(", "x" * 5000]),
    st.builds(lambda n: "y" * n, st.integers(10_000, 300_000)),
)
scalars = st.one_of(st.none(), st.booleans(), edge_ints, edge_floats, strings)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text(max_size=12), children, max_size=6),
    ),
    max_leaves=30,
)


# -- bodies ---------------------------------------------------------------------------------------

Strategies = dict[str, st.SearchStrategy[Any]]


def anything_goes(fields: list[str], own: Strategies) -> Any:
    """Any of `fields`, each holding its own kind of value or a value of any type, plus
    unknown keys."""
    optional = {f: st.one_of(own.get(f, json_values), json_values) for f in fields}
    return st.builds(
        lambda known, unknown: {**unknown, **known},
        st.fixed_dictionaries({}, optional=optional),
        st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    )


def nearly_valid(required: Strategies, valid: Strategies, fields: list[str]) -> Any:
    """A valid body but for at most two of `fields` holding a value of any type: the kind
    that gets past the first checks and reaches the engine."""
    return st.builds(
        lambda base, extra, hostile: {**base, **extra, **hostile},
        st.fixed_dictionaries(required),
        st.fixed_dictionaries({}, optional=valid),
        st.dictionaries(st.sampled_from(fields), json_values, max_size=2),
    )


def bodies(required: Strategies, valid: Strategies, fields: list[str]) -> Any:
    """Two parts nearly valid bodies to one part anything-goes ones."""
    nearly = nearly_valid(required, valid, fields)
    return st.one_of(nearly, nearly, anything_goes(fields, {**required, **valid}))


token = st.integers(0, 258)  # the sim model's vocabulary
texts = st.text(min_size=1, max_size=24)
stop_regexes = st.sampled_from(["a", "[a-z]+ ", "(", "x{2,}", "\\d", "(a|b)*c"])
sampling_valid: Strategies = {
    "min_new_tokens": st.integers(0, 4),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.just(-1), st.integers(1, 50)),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "stop": st.one_of(texts, st.lists(texts, max_size=3)),
    "stop_token_ids": st.lists(token, max_size=3),
    "stop_regex": st.one_of(stop_regexes, st.lists(stop_regexes, max_size=2)),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "n": st.integers(1, 3),
    "stream_interval": st.integers(1, 5),
    "logit_bias": st.dictionaries(token.map(str), st.floats(-3, 3), max_size=3),
    "sampling_seed": edge_ints,
}
sampling_params = st.one_of(
    nearly_valid({"max_new_tokens": st.integers(0, 24)}, sampling_valid, SAMPLING_FIELDS),
    anything_goes(SAMPLING_FIELDS, {"max_new_tokens": st.integers(-2, 40)}),
)
generate_valid: Strategies = {
    "sampling_params": st.one_of(sampling_params, st.lists(sampling_params, max_size=3)),
    "stream": st.booleans(),
    "rid": st.one_of(texts, st.lists(texts, max_size=3)),
    "return_logprob": st.booleans(),
    "logprob_start_len": st.integers(-1, 4),
    "top_logprobs_num": st.integers(0, 5),
    "token_ids_logprob": st.lists(token, max_size=3),
    "return_text_in_logprobs": st.booleans(),
}
openai_valid: Strategies = {
    "max_tokens": st.integers(0, 24),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "seed": edge_ints,
    "rid": texts,
    "user": texts,
    "min_tokens": st.integers(0, 4),
    **{k: sampling_valid[k] for k in ("temperature", "top_p", "top_k", "stop", "logit_bias")},
}
token_prompt = st.lists(token, min_size=1, max_size=8)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}
)

BODIES: dict[str, Any] = {
    "/generate": st.one_of(
        bodies({"text": texts}, generate_valid, GENERATE_FIELDS),
        bodies({"text": st.lists(texts, min_size=1, max_size=3)}, generate_valid, GENERATE_FIELDS),
        bodies({"input_ids": token_prompt}, generate_valid, GENERATE_FIELDS),
    ),
    "/v1/completions": bodies(
        {"prompt": st.one_of(texts, token_prompt, st.lists(texts, min_size=1, max_size=3))},
        {**openai_valid, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
        COMPLETION_FIELDS,
    ),
    "/v1/chat/completions": bodies(
        {"messages": st.lists(message, min_size=1, max_size=3)},
        {**openai_valid, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)},
        CHAT_FIELDS,
    ),
    "/abort_request": bodies(
        {},
        {
            "rid": st.one_of(st.sampled_from([VICTIM, f"{VICTIM}_1", "vic", ""]), texts),
            "abort_all": st.booleans(),
        },
        ABORT_FIELDS,
    ),
}


# -- bytes ----------------------------------------------------------------------------------------


def encode(body: Any) -> bytes:
    """JSON, except that the NaN and infinity placeholders become bare literals."""
    text = json.dumps(body, ensure_ascii=False)
    for placeholder, literal in ((_NAN, "NaN"), (_INF, "Infinity"), (_NEG_INF, "-Infinity")):
        text = text.replace(json.dumps(placeholder), literal)
    return text.encode()


def corrupt(raw: bytes, how: str, at: int) -> bytes:
    at %= max(len(raw), 1)
    if how == "invalid utf-8":
        return raw[:at] + b"\xff\xc3(" + raw[at:]
    if how == "unpaired surrogate":  # inside a string, an escape JSON allows and Unicode not
        return raw[:at] + b"\\ud800" + raw[at:]
    if how == "cut":
        return raw[:at]
    if how == "deep nesting":
        return b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    if how == "not json":
        return b"text=hi&stream=true"
    return raw


CORRUPTIONS = ["invalid utf-8", "unpaired surrogate", "cut", "deep nesting", "not json"]
raw_bodies = {
    path: st.builds(
        corrupt,
        strategy.map(encode),
        st.sampled_from(["none"] * 12 + CORRUPTIONS),
        st.integers(0, 10_000),
    )
    for path, strategy in BODIES.items()
}


# -- a server in a thread ----------------------------------------------------------------------


def fuzz_runner() -> SimRunner:
    """A sim runner for `FUZZ_ENGINE` whose model has a chat template."""
    return chat_sim_runner(FUZZ_ENGINE)


@dataclasses.dataclass
class ThreadedServer:
    """An engine, its app (in memory) and a real Hypercorn for it, on a Trio loop running in
    a thread of its own, so that synchronous tests (Hypothesis's) can call into it."""

    token: trio.lowlevel.TrioToken
    engine: Engine
    client: AppClient
    url: str

    def run(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `afn(*args)` on the server's loop; wait for its result."""
        return trio.from_thread.run(afn, *args, trio_token=self.token)


@contextmanager
def threaded_server() -> Iterator[ThreadedServer]:
    ready: list[ThreadedServer] = []
    started, failed = threading.Event(), []
    stop: list[trio.Event] = []

    async def main() -> None:
        stop.append(trio.Event())
        async with open_engine(FUZZ_ENGINE, runner=fuzz_runner()) as engine:
            app = create_app(engine, server_settings())
            async with open_http_server(app) as urls:
                token = trio.lowlevel.current_trio_token()
                ready.append(ThreadedServer(token, engine, AppClient(app), urls[0]))
                started.set()
                await stop[0].wait()

    def thread() -> None:
        try:
            trio.run(main)
        except BaseException as exc:
            failed.append(exc)
            started.set()

    worker = threading.Thread(target=thread, name="fuzz-server", daemon=True)
    worker.start()
    started.wait(30)
    if failed or not ready:
        raise RuntimeError("the fuzz server did not start") from (failed or [None])[0]
    try:
        yield ready[0]
    finally:
        trio.from_thread.run_sync(stop[0].set, trio_token=ready[0].token)
        worker.join(30)
        if failed:
            raise failed[0]
