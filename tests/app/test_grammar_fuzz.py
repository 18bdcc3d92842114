"""Fuzzing the grammar compile path against `tributary serve` on the real model, in
a subprocess: Hypothesis builds JSON schemas, regexes, EBNF grammars and stop regexes nested,
chained and repeated up to thousands deep (around every bound in engine/grammar_bounds.py),
and sends them as `json_schema`, `regex`, `ebnf`, `stop_regex` and OpenAI's `response_format`.

Every answer must be a 200 or a 4xx, within `ANSWER_TIME`, and the server process must be
alive after every example (a compiler crash kills it: SIGSEGV, or the OOM killer); after any
example slower than `SLOW`, and at the end, `/health` answers and a cheap grammar request is
served within grammarserver.CHEAP_GRAMMAR_TIME (a compile left running would hold a slot).
The strategies include the shapes known to get past the bounds: patterns intersected
through `allOf` (directly and through merged `properties`), hundreds of `patternProperties`,
and regex forms the `regex` package reads differently (`[[]`, `(?#...)`, `(?x)`).

A second test does the same, with fewer examples, through a front (`--worker-url`) over two
worker subprocesses, and checks that both workers are alive afterwards.

Examples are derandomized (the same every run). TRIBUTARY_GRAMMAR_FUZZ_EXAMPLES sets how many
per field (400 by default: 2,000 in all, plus 250 through the front); docs/reliability.md
records longer runs. Requests ask for 1-2 tokens, so a 200 is cheap.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from grammarserver import MODEL_FLAGS, Served, check_serving, served, served_front
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.model

EXAMPLES = int(os.environ.get("TRIBUTARY_GRAMMAR_FUZZ_EXAMPLES", "400"))
#: Seconds any answer may take: a refusal takes milliseconds, one by the checker process at
#: most its CHECK_TIMEOUT (5 s), a compile within the bounds well under a second, a 1-token
#: generation tens of ms (generous for a loaded machine).
ANSWER_TIME = 12.0
#: An example slower than this is followed by a check that a cheap grammar is served at once.
SLOW = 1.0
FUZZ_SETTINGS = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
FIELDS = ["json_schema", "regex", "ebnf", "stop_regex", "response_format"]

# -- strategies ----------------------------------------------------------------------------
# Everything is built as text by concatenation (never recursion), so a schema 3,000 deep costs
# the test nothing and Python's recursion limit never comes into it.

#: Sizes around the bounds: mostly small, sometimes at or past a limit (64 groups, 128 levels,
#: 1,000 refs or rules), sometimes far past.
sizes = st.one_of(
    st.integers(0, 6),
    st.integers(7, 140),
    st.sampled_from([63, 64, 65, 127, 128, 129, 999, 1000, 1001, 3000]),
)
counts = st.one_of(
    st.integers(0, 12),
    st.sampled_from([100, 1000, 9999, 10_000, 10_001, 65_535, 10**6, 10**9, 10**30]),
)

ATOMS = ["a", "[a-z]", r"\d", ".", "(ab|cd)", "[^x]", r"\w", r"\p{L}", "x*", "(?:y|z)+"]
#: Forms the `regex` package (stop_regex) parses differently from the bounds' scan.
ODD_ATOMS = ["[[]a", "[^[]", "[a[b]", "(?#()", "(?#)x", "(?x)a", "(?ix)a", "a{ 3 }", "[]]"]
#: Patterns whose intersection the compiler builds in exponential time and memory.
INTERSECTED = [f".*{chr(97 + i)}.*{chr(97 + (i * 7) % 26)}" for i in range(26)]


@st.composite
def regexes(draw: st.DrawFn, max_ops: int = 4) -> str:
    text = draw(st.sampled_from(ATOMS))
    if draw(st.integers(0, 4)) == 0:
        text = draw(st.sampled_from(ODD_ATOMS)) + text
    for _ in range(draw(st.integers(0, max_ops))):
        op = draw(st.sampled_from(["count", "range", "nest", "alt", "concat", "star"]))
        if op == "count":
            text = f"(?:{text}){{{draw(counts)}}}"
        elif op == "range":
            text = f"({text}){{{draw(counts)},{draw(counts)}}}"
        elif op == "nest":
            n = draw(sizes)
            text = "(" * n + text + ")" * n
        elif op == "alt":
            text = "|".join([text] * draw(st.integers(2, 2000)))
        elif op == "concat":
            text = text * draw(st.integers(2, 3000))
        else:
            text = f"({text})*"
        if len(text) > 600_000:
            break
    if draw(st.integers(0, 9)) == 0:  # unbalanced or cut
        text = text[: draw(st.integers(0, len(text)))]
    return text


WRAPPERS = {
    "object": ('{"type":"object","properties":{"a":', '},"required":["a"]}'),
    "anyOf": ('{"anyOf":[', ',{"type":"integer"}]}'),
    "allOf": ('{"allOf":[', "]}"),
    "oneOf": ('{"oneOf":[', ',{"type":"null"}]}'),
    "array": ('{"type":"array","items":', ',"maxItems":3}'),
    "not": ('{"type":"object","properties":{"b":{"not":', "}}}"),
}


@st.composite
def leaves(draw: st.DrawFn) -> str:
    kind = draw(
        st.sampled_from(
            ["string", "pattern", "integer", "enum", "props", "const", "allOf", "patprops"]
        )
    )
    if kind == "pattern":
        return json.dumps({"type": "string", "pattern": draw(regexes(max_ops=2))})
    if kind == "allOf":  # patterns the compiler intersects: on one string, or one property
        n = draw(st.one_of(st.integers(2, 10), st.sampled_from([12, 16, 24])))
        patterns = (
            INTERSECTED[:n]
            if draw(st.booleans())
            else draw(st.lists(regexes(1), min_size=n, max_size=n))
        )
        if draw(st.booleans()):
            return json.dumps({"type": "string", "allOf": [{"pattern": p} for p in patterns]})
        return json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "allOf": [{"properties": {"a": {"pattern": p}}} for p in patterns],
            }
        )
    if kind == "patprops":
        n = draw(st.one_of(st.integers(1, 70), st.sampled_from([128, 500, 1000])))
        keys = {f"^k{i}[a-z]*$": {"type": "integer"} for i in range(n)}
        return json.dumps({"type": "object", "patternProperties": keys})
    if kind == "integer":
        low, high = draw(st.integers(-(10**20), 10**20)), draw(st.integers(-(10**20), 10**20))
        return json.dumps({"type": "integer", "minimum": low, "maximum": high})
    if kind == "enum":
        return json.dumps({"enum": [f"v{i}" for i in range(draw(counts) % 12_000)]})
    if kind == "props":
        n = draw(counts) % 12_000
        props = ",".join(f'"p{i}":{{"type":"integer"}}' for i in range(n))
        return '{"type":"object","properties":{' + props + "}}"
    if kind == "const":
        return json.dumps({"const": "x" * (draw(counts) % 1_200_000)})
    return '{"type":"string"}'


@st.composite
def json_schemas(draw: st.DrawFn) -> str:
    text = draw(leaves())
    for kind, n in draw(st.lists(st.tuples(st.sampled_from(list(WRAPPERS)), sizes), max_size=3)):
        before, after = WRAPPERS[kind]
        text = before * n + text + after * n
    refs = draw(st.one_of(st.just(0), st.integers(1, 40), st.sampled_from([999, 1000, 3000])))
    if refs:
        shape = draw(st.sampled_from(["chain", "cycle", "fan"]))
        defs = []
        for i in range(refs):
            if shape == "fan":
                body = text if i == 0 else '{"$ref":"#/$defs/d0"}'
            elif i + 1 < refs:
                body = f'{{"$ref":"#/$defs/d{i + 1}"}}'
            else:
                body = '{"$ref":"#/$defs/d0"}' if shape == "cycle" else text
            defs.append(f'"d{i}":{body}')
        root = '{"anyOf":[' + ",".join(f'{{"$ref":"#/$defs/d{i}"}}' for i in range(refs)) + "]"
        root = root if shape == "fan" else '{"$ref":"#/$defs/d0"'
        text = root + ',"$defs":{' + ",".join(defs) + "}}"
    how = draw(st.sampled_from(["as is"] * 8 + ["cut", "garbage"]))
    if how == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif how == "garbage":
        text = "[" * draw(sizes) + text
    return text


@st.composite
def ebnfs(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["chain", "nest", "alts", "repeat", "regex", "lark", "loop"]))
    n = draw(sizes)
    if kind == "chain":
        rules = "".join(f"r{i} ::= r{i + 1}\n" for i in range(n))
        return f'root ::= r0\n{rules}r{n} ::= "a"\n'
    if kind == "nest":
        inner = draw(st.sampled_from(['"a"', '"a" | "b"', "[a-z]+", '"a"*']))
        return "root ::= " + "(" * n + inner + ")" * n
    if kind == "alts":
        k = draw(st.one_of(st.integers(1, 50), st.sampled_from([1000, 10_000, 100_000])))
        return "root ::= " + " | ".join(f'"w{i}"' for i in range(k))
    if kind == "repeat":
        return f'root ::= ("ab"{{{draw(counts)}}}){{{draw(counts)}}}'
    if kind == "regex":
        return "start: /" + draw(regexes(max_ops=2)).replace("/", "\\/") + "/"
    if kind == "lark":
        return "start: " + "(" * n + '"a"' + ")" * n
    return "root ::= x\nx ::= root"


stop_regexes = st.lists(regexes(max_ops=3).map(lambda r: r[:300]), min_size=1, max_size=3)

VALUES = {
    "json_schema": json_schemas(),
    "regex": regexes(),
    "ebnf": ebnfs(),
    "stop_regex": stop_regexes,
    "response_format": json_schemas(),
}


def request(field: str, value: Any, tokens: int, route: str) -> tuple[str, bytes]:
    """The path and body. A response_format schema is spliced in as text: it may be nested
    too deeply for a JSON encoder, or not be JSON at all."""
    if field == "response_format":
        fmt = '{"type":"json_schema","json_schema":{"name":"x","schema":' + value + "}}"
        if route == "chat":
            head = '{"messages":[{"role":"user","content":"Hi"}],'
            return (
                "/v1/chat/completions",
                f'{head}"max_tokens":{tokens},"response_format":{fmt}}}'.encode(),
            )
        return (
            "/v1/completions",
            f'{{"prompt":"Hi","max_tokens":{tokens},"response_format":{fmt}}}'.encode(),
        )
    if route == "generate":
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": tokens, field: value}}
        return "/generate", json.dumps(body).encode()
    body = {"prompt": "Hi", "max_tokens": tokens, field: value, "temperature": 0}
    return "/v1/completions", json.dumps(body).encode()


def fuzz(client: httpx.Client, field: str, examples: int, processes: list[Served]) -> list[int]:
    """Run `examples` examples of `field`; the statuses seen."""
    statuses: list[int] = []

    @settings(FUZZ_SETTINGS, max_examples=examples)
    @given(
        value=VALUES[field],
        tokens=st.integers(1, 2),
        route=st.sampled_from(["generate", "completions", "chat"]),
    )
    def example(value: Any, tokens: int, route: str) -> None:
        if field != "response_format" and route == "chat":
            route = "generate"
        path, body = request(field, value, tokens, route)
        start = time.monotonic()
        reply = client.post(path, content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - start
        for proc in processes:
            assert proc.alive, (field, body[:300], proc.why_dead())
        assert reply.status_code == 200 or 400 <= reply.status_code < 500, (
            field,
            body[:300],
            reply.status_code,
            reply.text[:300],
        )
        assert took < ANSWER_TIME, (field, body[:300], took)
        if took > SLOW:  # whatever made it slow must not hold a compile slot afterwards
            check_serving(client, *processes)
        statuses.append(reply.status_code)

    example()
    return statuses


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with served(*MODEL_FLAGS, "--log-level", "error") as running:
        yield running


@pytest.mark.parametrize("field", FIELDS)
def test_grammar_fuzz_never_crashes_or_stalls(server: Served, field: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        statuses = fuzz(client, field, EXAMPLES, [server])
        check_serving(client, server)
    # The strategies reach both sides: grammars that compile and run, and ones refused.
    assert 200 in statuses and 400 in statuses, sorted(set(statuses))
    print(f"{field}: {len(statuses)} examples, {statuses.count(200)} answered 200")


def test_grammar_fuzz_through_a_front_keeps_both_workers_alive() -> None:
    with served_front(*MODEL_FLAGS, "--log-level", "error") as (front, workers):
        with httpx.Client(base_url=front.url, timeout=60) as client:
            for field in FIELDS:
                fuzz(client, field, max(EXAMPLES // 8, 10), [front, *workers])
            check_serving(client, front, *workers)
