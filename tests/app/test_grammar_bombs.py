"""Grammar bombs: no `json_schema`, `regex`, `ebnf`, `response_format` or
`stop_regex` a client sends may crash or stall the server. Each shape below crashed (SIGSEGV,
or the kernel's OOM kill), stalled for seconds, or answered 500 before the bounds in
engine/grammar_bounds.py and the compile threads in engine/grammar.py (docs/reliability.md,
"Grammar bombs").

The first tests need no model: the bounds' edges, real schemas inside them, and the stack the
deepest schema within them needs. The last ones send every bomb to `tributary serve` on the
real model in a subprocess, so that a crash shows as a dead process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from grammarserver import MODEL_FLAGS, TOOL_SCHEMA, Served, check_serving, served
from test_generate_grammar import ANSWER_EBNF, PERSON_SCHEMA, REGEXES, STOP_REGEXES

from tributary.engine import grammar_guard
from tributary.engine.errors import BadRequest, InvalidSamplingParams
from tributary.engine.grammar_bounds import (
    MAX_ALLOF_PATTERNS,
    MAX_EBNF_BYTES,
    MAX_EBNF_NESTING,
    MAX_EBNF_RULES,
    MAX_JSON_DEPTH,
    MAX_PATTERN_PROPERTIES,
    MAX_REGEX_BYTES,
    MAX_REGEX_NESTING,
    MAX_REGEX_REPEAT,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_NODES,
    MAX_SCHEMA_REFS,
    ebnf_problem,
    json_depth,
    json_schema_problem,
    regex_problem,
    stop_regex_problem,
)
from tributary.engine.sampling import SamplingParams

# -- hostile shapes ------------------------------------------------------------------------


def ref_chain(n: int) -> dict[str, Any]:
    """The issue's schema: a0 -> a1 -> ... -> an, a string at the end."""
    defs: dict[str, Any] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/a0", "$defs": defs}


def nested_text(n: int, wrapper: dict[str, Any]) -> str:
    """`wrapper` (with "@" where the inner schema goes) nested n deep, as JSON text: built
    without recursion, so that the test itself never hits Python's recursion limit."""
    before, after = json.dumps(wrapper).split('"@"')
    return before * n + '{"type": "string"}' + after * n


OBJECT = {"type": "object", "properties": {"a": "@"}, "required": ["a"]}
ANY_OF = {"anyOf": ["@", {"type": "integer"}]}
ARRAY = {"type": "array", "items": "@"}


def deepest_within_bounds(refs: int = 200, nodes: int = MAX_SCHEMA_NODES) -> str:
    """The schema that makes the compiler recurse deepest within the bounds (measured over
    100-1,000 defs): `refs` defs in a chain, each nesting objects as deep as the node budget
    allows (an object level is 3 containers: itself, `properties`, `required`)."""
    levels = (nodes - 2 - refs) // refs // 3
    defs = {}
    for i in range(refs):
        last = i + 1 == refs
        inner: dict[str, Any] = {"type": "string"} if last else {"$ref": f"#/$defs/d{i + 1}"}
        for _ in range(levels):
            inner = {"type": "object", "properties": {"x": inner}, "required": ["x"]}
        defs[f"d{i}"] = inner
    return json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def allof_patterns(n: int) -> dict[str, Any]:
    """One string under an allOf of n patterns, which the compiler
    intersects (n=16: 0.7 s and 216 MB; 20: 24 s and 2.35 GB; 24: an abort allocating 5 GB)."""
    return {"type": "string", "allOf": [{"pattern": p} for p in INTERSECTED[:n]]}


#: Patterns whose intersection the compiler builds in exponential time and memory.
INTERSECTED = [f".*{chr(97 + i)}.*{chr(97 + (i * 7) % 26)}" for i in range(26)]


def property_allof(n: int) -> dict[str, Any]:
    """Within every bound: the same property constrained by n patterns through an allOf of
    `properties` (the bound counts patterns on one schema, not merged properties). Only the
    checker process stops it (n=20: past its time limit)."""
    return {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "required": ["a"],
        "allOf": [{"properties": {"a": {"pattern": p}}} for p in INTERSECTED[:n]],
    }


def pattern_properties(n: int) -> dict[str, Any]:
    """An object with n patternProperties (500 compiled for 28 s)."""
    return {"type": "object", "patternProperties": {f"^k{i}[a-z]*$": {} for i in range(n)}}


def ebnf_rule_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'


#: OpenAI's documented structured-output maxima: 5,000 properties, 10 levels of nesting,
#: 1,000 enum values. A schema at all three at once must be within the bounds.
OPENAI_MAXIMAL = {
    "type": "object",
    "properties": {
        **{f"field_{i}": {"type": "string", "maxLength": 40} for i in range(4990)},
        "kind": {"enum": [f"kind_{i}" for i in range(1000)]},
        "deep": json.loads(nested_text(9, OBJECT)),
    },
    "required": ["kind", "deep"],
    "additionalProperties": False,
}

# -- the bounds, without a model -------------------------------------------------------------


def test_real_grammars_are_within_the_bounds() -> None:
    for schema in (PERSON_SCHEMA, TOOL_SCHEMA, OPENAI_MAXIMAL, {"type": "object"}):
        assert json_schema_problem(json.dumps(schema)) is None
    for _, pattern in REGEXES:
        assert regex_problem(pattern) is None
    for patterns in STOP_REGEXES:
        assert all(regex_problem(p) is None for p in patterns)
    for pattern in (r"[a-z]{1,10000}", r"\d{3}-\d{4}", r"\p{L}{2,8}", r"(?i)(yes|no)", r"a{,5}"):
        assert regex_problem(pattern) is None, pattern
    assert ebnf_problem(ANSWER_EBNF) is None
    assert ebnf_problem(ebnf_rule_chain(MAX_EBNF_RULES - 2)) is None


def test_each_bound_is_exact_and_named_in_the_message() -> None:
    # JSON nesting (counted by a scan, before parsing)
    assert json_schema_problem(nested_text(MAX_JSON_DEPTH - 1, ARRAY)) is None
    too_deep = json_schema_problem(nested_text(MAX_JSON_DEPTH, ARRAY))
    assert too_deep and "nested too deeply" in too_deep and f"{MAX_JSON_DEPTH}" in too_deep
    # $refs
    assert json_schema_problem(json.dumps(ref_chain(MAX_SCHEMA_REFS - 1))) is None
    refs = json_schema_problem(json.dumps(ref_chain(MAX_SCHEMA_REFS)))
    assert refs and f"{MAX_SCHEMA_REFS} $refs" in refs
    # objects and arrays
    wide = {"anyOf": [{"const": i} for i in range(MAX_SCHEMA_NODES)]}
    nodes = json_schema_problem(json.dumps(wide))
    assert nodes and f"{MAX_SCHEMA_NODES} objects and arrays" in nodes
    wide["anyOf"] = wide["anyOf"][: MAX_SCHEMA_NODES - 3]
    assert json_schema_problem(json.dumps(wide)) is None
    # size
    size = json_schema_problem(json.dumps({"const": "x" * MAX_SCHEMA_BYTES}))
    assert size and f"{MAX_SCHEMA_BYTES} bytes" in size
    # regexes, alone and inside a schema
    assert regex_problem("(" * MAX_REGEX_NESTING + "a" + ")" * MAX_REGEX_NESTING) is None
    nesting = regex_problem("(" * (MAX_REGEX_NESTING + 1) + "a" + ")" * (MAX_REGEX_NESTING + 1))
    assert nesting and f"{MAX_REGEX_NESTING}" in nesting
    assert regex_problem(f"a{{{MAX_REGEX_REPEAT}}}") is None
    assert f"{MAX_REGEX_REPEAT}" in (regex_problem(f"a{{{MAX_REGEX_REPEAT + 1}}}") or "")
    assert regex_problem("(a{100}){100}") is None
    assert "expand" in (regex_problem("(a{100}){101}") or "")
    assert "expand" in (regex_problem("((a{10}){10}b){101}") or "")
    assert "repetition count" in (regex_problem("a{99999999999999999999999}") or "")
    assert f"{MAX_REGEX_BYTES} bytes" in (regex_problem("a" * (MAX_REGEX_BYTES + 1)) or "")
    # Brackets, braces and parentheses inside classes and escapes are not structure.
    assert regex_problem(r"[(]{5}\({5}[\]{]" * 50) is None
    pattern = json_schema_problem(json.dumps({"type": "string", "pattern": "a{1000000}"}))
    assert pattern and "pattern" in pattern and "repetition count" in pattern
    ws = {"type": "object", "x-guidance": {"whitespace_pattern": "( ){100000}"}}
    assert "whitespace_pattern" in (json_schema_problem(json.dumps(ws)) or "")
    keys = {"type": "object", "patternProperties": {"^(((a{100}){100}){100})$": {}}}
    assert "patternProperties" in (json_schema_problem(json.dumps(keys)) or "")
    # ebnf
    assert f"{MAX_EBNF_RULES}" in (ebnf_problem(ebnf_rule_chain(MAX_EBNF_RULES)) or "")
    parens = "root ::= " + "(" * MAX_EBNF_NESTING + '"a"' + ")" * MAX_EBNF_NESTING
    assert ebnf_problem(parens) is None
    assert f"{MAX_EBNF_NESTING}" in (ebnf_problem(parens.replace("(", "((", 1) + ")") or "")
    assert ebnf_problem('root ::= "((((" [(((] ' + '"(" ' * 100) is None  # literals, classes
    assert f"{MAX_EBNF_BYTES} bytes" in (ebnf_problem("root ::= " + '"a" ' * MAX_EBNF_BYTES) or "")
    assert "%json" in (ebnf_problem('start: %json {"type": "object"}') or "")
    assert ebnf_problem('root ::= "100%json" [%]') is None  # a literal, not the directive
    lark_rules = "".join(f'{p}r{i}: "a"\n' for i, p in enumerate(["?", "!", ""] * 334))
    assert f"{MAX_EBNF_RULES}" in (ebnf_problem(lark_rules) or "")  # ?rule and !rule count
    # patterns intersected through an allOf ($refs followed), patternProperties
    assert json_schema_problem(json.dumps(allof_patterns(MAX_ALLOF_PATTERNS))) is None
    many = json_schema_problem(json.dumps(allof_patterns(MAX_ALLOF_PATTERNS + 1)))
    assert many and "allOf" in many and f"{MAX_ALLOF_PATTERNS}" in many
    own = {**allof_patterns(MAX_ALLOF_PATTERNS), "pattern": "x"}  # its own pattern counts
    assert "allOf" in (json_schema_problem(json.dumps(own)) or "")
    half = [{"pattern": p} for p in INTERSECTED[:5]]
    by_ref = {"allOf": [{"$ref": "#/$defs/h"}, *half], "$defs": {"h": {"allOf": half}}}
    assert "allOf" in (json_schema_problem(json.dumps(by_ref)) or "")
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}, *half]}}}
    assert json_schema_problem(json.dumps(cycle)) is None
    keys = json.dumps(pattern_properties(MAX_PATTERN_PROPERTIES))
    assert json_schema_problem(keys) is None
    keys = json_schema_problem(json.dumps(pattern_properties(MAX_PATTERN_PROPERTIES + 1)))
    assert keys and "patternProperties" in keys and f"{MAX_PATTERN_PROPERTIES}" in keys


def test_nesting_is_counted_by_a_linear_scan_that_skips_strings() -> None:
    assert json_depth(json.dumps({"a": "[[[[{{{{", "b": [["]]]"]]})) == 3
    assert json_depth('{"a": "\\"[[[["}') == 1
    # Hostile text that is not JSON: strings that never end, a million quotes, a million
    # brackets. Each is judged in well under a second (a scan that restarted at each quote
    # would take minutes).
    for text in ('"' + 'a\\"' * 340_000, '"' * 1_000_000, "[" * 1_000_000):
        start = time.perf_counter()
        json_schema_problem(text)
        assert time.perf_counter() - start < 1.0


def test_a_bomb_in_stop_regex_is_a_400_not_an_allocation() -> None:
    # `regex.compile("a{1000000000}")` allocates until the kernel kills the process.
    for pattern in ("a{1000000000}", "(?:(?:a{65535}){65535}){65535}", "(?:a{1000}){1000}"):
        params = SamplingParams.from_dict({"stop_regex": ["fine", pattern]})
        with pytest.raises(InvalidSamplingParams, match=r"invalid stop_regex .*(count|expand)"):
            params.verify(100)


#: stop_regex forms the `regex` package parses differently from the bounds' scan: each hid a
#: repetition from it (MemoryError, or hundreds of MB) before.
STOP_REGEX_BYPASSES = [
    "[[]a{1000000000}]",  # to `regex`, a class holding "[", then a{1000000000}
    "[^[]a{1000000000}]",
    "[a[b]a{1000000000}]",
    "(?x)a{ 1000000000 }",  # verbose: spaces inside the count
    "(?ix)a{ 1000000000 }",
    "((a{100}(?#()){100}(?#()){100}",  # parentheses inside comments
]


def test_stop_regex_forms_the_scan_reads_differently_are_refused() -> None:
    for pattern in STOP_REGEX_BYPASSES:
        problem = stop_regex_problem(pattern)
        assert problem and "not supported in stop_regex" in problem, pattern
        params = SamplingParams.from_dict({"stop_regex": [pattern]})
        with pytest.raises(InvalidSamplingParams, match="not supported in stop_regex"):
            params.verify(100)
    # What real stop regexes use stays allowed.
    for pattern in (r"\[\[x", r"[\[\]]", "[]]", "(?i)stop", r"\(?x", "(?P<n>a)", "[(?#]"):
        assert stop_regex_problem(pattern) is None, pattern


# -- the checker process (engine/grammar_guard.py), without a model -------------------------


@pytest.fixture
def fresh_checker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fresh children and an empty cache, stopped afterwards (no process outlives the test)."""
    grammar_guard.shutdown()
    grammar_guard.clear_cache()
    yield
    grammar_guard.shutdown()
    grammar_guard.clear_cache()


def refusal(kind: str, source: str) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(BadRequest) as info:
        grammar_guard.check_grammar(kind, source)
    return str(info.value), time.monotonic() - start


def test_the_checker_contains_memory_and_time_bombs(
    fresh_checker: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grammar that needs gigabytes kills only its checker (a 400), one that runs long is
    killed at the time limit (a 400); neither verdict is remembered (it depends on the
    machine's load too), while llguidance's own refusals are; the next grammar checks on a
    fresh child."""
    monkeypatch.setattr(grammar_guard, "CHILD_MEMORY_BYTES", 256 << 20)
    monkeypatch.setattr(grammar_guard, "CHECK_TIMEOUT", 30.0)
    bomb = json.dumps(allof_patterns(24))  # over the bounds: the checker alone
    message, took = refusal("json_schema", bomb)
    assert "needs more memory than the server allows" in message and took < 30, message
    grammar_guard.check_grammar("json_schema", json.dumps(TOOL_SCHEMA))
    monkeypatch.setattr(grammar_guard, "CHECK_TIMEOUT", 1.0)
    slow = json.dumps(pattern_properties(500))
    message, took = refusal("json_schema", slow)
    assert "needs more time than the server allows" in message and took < 3, message
    message, took = refusal("json_schema", slow)  # asked again, not remembered
    assert "needs more time" in message and took >= 0.9, (message, took)
    grammar_guard.check_grammar("regex", "(yes|no)")
    message, _ = refusal("regex", "(yes|no")  # an ordinary refusal, in llguidance's words
    assert "unclosed group" in message
    message, took = refusal("regex", "(yes|no")  # remembered
    assert "unclosed group" in message and took < 0.05


def test_a_checker_killed_from_outside_is_a_503_and_ctrl_c_does_not_reach_it(
    fresh_checker: None,
) -> None:
    """A checker ended by something other than its grammar (a signal, the OOM killer) says
    nothing of the grammar: a 503, not remembered. The children run in a session of their
    own (a Ctrl-C to the server's process group is the server's), without core files."""
    grammar_guard.check_grammar("regex", "x+")
    children = list(grammar_guard._pool._all)
    assert children
    for child in children:
        assert os.getsid(child.proc.pid) == child.proc.pid  # a session of its own
        with open(f"/proc/{child.proc.pid}/limits") as limits:
            core = next(line for line in limits if line.startswith("Max core file size"))
        assert core.split()[4] == "0", core
        os.kill(child.proc.pid, signal.SIGINT)  # ignored
    time.sleep(0.2)
    assert all(child.alive for child in children)
    for child in children:
        os.kill(child.proc.pid, signal.SIGTERM)
    for child in children:
        child.proc.wait()
    with pytest.raises(grammar_guard.GrammarCompilerBusy):
        _check_on_dead_child("regex", "y+")
    grammar_guard.check_grammar("regex", "y+")  # not remembered: a fresh child accepts it


def _check_on_dead_child(kind: str, source: str) -> None:
    """check_grammar with the pool's dead children handed out as if alive (the moment a
    signal lands between the pool's liveness check and the job)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grammar_guard._Child, "alive", property(lambda self: True))
        grammar_guard.check_grammar(kind, source)


def test_a_busy_checker_pool_is_a_503(fresh_checker: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar_guard, "CHECK_TIMEOUT", 2.0)
    monkeypatch.setattr(grammar_guard, "BUSY_TIMEOUT", 0.3)
    slow = [json.dumps(pattern_properties(500 + i)) for i in range(grammar_guard.POOL_SIZE)]
    errors: list[BaseException] = []

    def hold(source: str) -> None:
        try:
            grammar_guard.check_grammar("json_schema", source)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hold, args=(s,)) for s in slow]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # both children busy now
    with pytest.raises(grammar_guard.GrammarCompilerBusy) as busy:
        grammar_guard.check_grammar("regex", "(a|b)")
    assert busy.value.http_status == 503
    for thread in threads:
        thread.join()
    assert all(isinstance(e, BadRequest) and "more time" in str(e) for e in errors), errors
    grammar_guard.check_grammar("regex", "(a|b)")  # free again


def test_checker_children_end_with_shutdown(fresh_checker: None) -> None:
    grammar_guard.check_grammar("regex", "x+")
    pids = [c.proc.pid for c in grammar_guard._pool._all]
    assert pids
    grammar_guard.shutdown()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped: not a child any more


#: Compiles the deepest schema within the bounds on a thread with `sys.argv[1]` MiB of stack.
STACK_PROBE = textwrap.dedent(
    """
    import sys, threading, llguidance
    from tributary.engine.grammar import _grammar
    source = sys.stdin.read()
    def compile():
        grammar = _grammar("json_schema", source)
        print(repr(llguidance.LLMatcher.validate_grammar(grammar, None)), flush=True)
    threading.stack_size(int(sys.argv[1]) << 20)
    thread = threading.Thread(target=compile)
    thread.start()
    thread.join()
    """
)


def test_the_deepest_schema_within_bounds_needs_the_compile_threads_stack() -> None:
    """What the compile threads are for: the deepest schema the bounds allow crashes a thread
    with the usual 8 MiB stack (SIGSEGV, the whole process), and compiles on a compile
    thread, with room to spare (it needed 16-24 MiB; the compile threads have 256 MiB)."""
    schema = deepest_within_bounds()
    assert json_schema_problem(schema) is None
    on_default = subprocess.run(
        [sys.executable, "-c", STACK_PROBE, "8"], input=schema.encode(), capture_output=True
    )
    if on_default.returncode >= 0:
        pytest.skip(f"llguidance no longer overflows an 8 MiB stack here: {on_default.stdout!r}")
    from tributary.engine.grammar import _grammar, compile_on_big_stack

    def validate() -> str:
        import llguidance

        return str(llguidance.LLMatcher.validate_grammar(_grammar("json_schema", schema), None))

    assert compile_on_big_stack(validate) == ""


# -- every bomb against a live server ------------------------------------------------------


#: (where, the grammar fields, what the 400's message must contain). `where` is "generate"
#: (sampling_params), "chat" or "completions" (top-level fields of /v1).
def fmt(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format for `schema`."""
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


REFS = f"{MAX_SCHEMA_REFS} $refs"
MANY_CONSTS = json.dumps({"anyOf": [{"const": i} for i in range(20_000)]})
ALTERNATIVES = "root ::= " + " | ".join(f'"w{i}"' for i in range(100_000))
BOMBS: list[tuple[str, dict[str, Any], str]] = [
    # The issue's report: SIGSEGV before.
    ("generate", {"json_schema": json.dumps(ref_chain(3000))}, REFS),
    # RecursionError in json.loads, a 500 before.
    ("generate", {"json_schema": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    ("generate", {"json_schema": nested_text(1000, OBJECT)}, "nested too deeply"),
    ("generate", {"json_schema": nested_text(1000, ANY_OF)}, "nested too deeply"),
    ("generate", {"json_schema": nested_text(300, ARRAY)}, "nested too deeply"),
    ("generate", {"json_schema": MANY_CONSTS}, "objects and arrays"),
    ("generate", {"json_schema": json.dumps({"const": "x" * 2_000_000})}, "bytes, over the limit"),
    # Lexer bombs: seconds of CPU at the first token, then an output of nothing, before.
    ("generate", {"json_schema": json.dumps({"pattern": "^a{1000000}$"})}, "repetition count"),
    ("generate", {"regex": "a{1000000}"}, "repetition count"),
    ("generate", {"regex": "(a{1000}){1000}"}, "expand to more than"),
    ("generate", {"regex": "(" * 1000 + "a" + ")" * 1000}, "nested more than"),
    ("generate", {"regex": "ab" * 500_000}, "bytes, over the limit"),
    # SIGSEGV (a chain of 5,000 rules) and a 30 s stall (100,000 alternatives) before.
    ("generate", {"ebnf": ebnf_rule_chain(5000)}, "rules, over the limit"),
    ("generate", {"ebnf": ALTERNATIVES}, "bytes, over the limit"),
    ("generate", {"ebnf": "root ::= " + "(" * 1000 + '"a"' + ")" * 1000}, "nested more than"),
    ("generate", {"ebnf": "start: %json " + json.dumps(ref_chain(3000))}, "%json"),
    # The kernel's OOM kill before.
    ("generate", {"stop_regex": "a{1000000000}"}, "repetition count"),
    ("generate", {"stop_regex": ["x", "(?:(?:a{100}){100}){100}"]}, "expand to more than"),
    # OpenAI's response_format becomes json_schema; /v1 takes the extras too.
    ("chat", {"response_format": fmt(ref_chain(3000))}, REFS),
    ("chat", {"response_format": fmt(json.loads(nested_text(200, OBJECT)))}, "nested too deeply"),
    ("completions", {"response_format": fmt(ref_chain(3000))}, REFS),
    ("completions", {"regex": "a{1000000}"}, "repetition count"),
    ("chat", {"ebnf": ebnf_rule_chain(5000)}, "rules, over the limit"),
    ("chat", {"json_schema": "[" * 100_000 + "]" * 100_000}, "nested too deeply"),
    ("completions", {"stop_regex": "a{1000000000}"}, "repetition count"),
    # Without their bounds: exponential memory (an abort allocating 5 GB) and a 28 s compile.
    ("generate", {"json_schema": json.dumps(allof_patterns(24))}, "allOf"),
    ("chat", {"response_format": fmt(allof_patterns(20))}, "allOf"),
    ("generate", {"json_schema": json.dumps(pattern_properties(500))}, "patternProperties"),
    *(("generate", {"stop_regex": p}, "not supported in stop_regex") for p in STOP_REGEX_BYPASSES),
]

#: Seconds a refusal may take (measured: milliseconds; generous for a loaded machine).
REFUSAL_TIME = 5.0


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    with served(*MODEL_FLAGS, "--log-level", "warning") as running:
        yield running


def bomb_request(where: str, fields: dict[str, Any], stream: bool) -> tuple[str, dict[str, Any]]:
    if where == "generate":
        sampling = {"max_new_tokens": 2, **fields}
        return "/generate", {"text": "Hi", "sampling_params": sampling, "stream": stream}
    body = {"max_tokens": 2, "stream": stream, **fields}
    if where == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Hi"}]}
    return "/v1/completions", {**body, "prompt": "Hi"}


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_every_bomb_is_a_fast_400_naming_its_limit(server: Served, stream: bool) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for where, fields, needle in BOMBS:
            path, body = bomb_request(where, fields, stream)
            start = time.monotonic()
            response = client.post(path, json=body)
            took = time.monotonic() - start
            assert server.alive, (where, needle, server.why_dead())
            assert response.status_code == 400, (where, needle, response.text[:300])
            message = response.json()["error"]["message"]
            assert needle in message, (where, message)
            assert took < REFUSAL_TIME, (where, needle, took)
        check_serving(client, server)


@pytest.mark.model
def test_the_deepest_schema_within_bounds_is_served(server: Served) -> None:
    """Within the bounds is served: the deepest schema they allow (which crashes an 8 MiB
    stack, test above) compiles on the compile threads and generates."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        sampling = {"max_new_tokens": 8, "temperature": 0, "json_schema": deepest_within_bounds()}
        response = client.post("/generate", json={"text": "JSON:", "sampling_params": sampling})
        assert response.status_code == 200, response.text[:300]
        assert response.json()["text"].startswith('{"x":')
        openai = {"type": "json_schema", "json_schema": {"name": "big", "schema": OPENAI_MAXIMAL}}
        chat = client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Fill the form."}],
                "max_tokens": 4,
                "response_format": openai,
            },
        )
        assert chat.status_code == 200, chat.text[:300]
        check_serving(client, server)


@pytest.mark.model
def test_a_bomb_within_every_bound_is_stopped_by_the_checker(server: Served) -> None:
    """The same property under 24 patterns through an allOf of `properties` is within every
    bound; its check runs past the checker's time limit (or memory), the child is killed, and
    the answer is a 400, again on a second ask (a verdict of time or memory is not
    remembered). The server lives, and a cheap grammar is served at once (nothing is left
    holding a compile slot)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        schema = json.dumps(property_allof(24))
        assert json_schema_problem(schema) is None
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "json_schema": schema}}
        for limit in (grammar_guard.CHECK_TIMEOUT + 3,) * 2:
            start = time.monotonic()
            response = client.post("/generate", json=body)
            took = time.monotonic() - start
            assert response.status_code == 400, response.text[:300]
            assert "needs more" in response.json()["error"]["message"]
            assert took < limit, took
        check_serving(client, server)
