"""Bounds on what a client may ask a grammar compiler to do, checked before it runs.

Synopsis::

    problem = json_schema_problem(text)    # None, or why the schema is refused
    problem = regex_problem(pattern)       # for `regex` and schema patterns
    problem = stop_regex_problem(pattern)  # for `stop_regex` (the `regex` package's syntax)
    problem = ebnf_problem(text)

llguidance (and the `regex` package, for `stop_regex`) compile what the client sends, in
this process, in native code. Some shapes crash or stall them (docs/reliability.md, "Grammar
bombs", has the measurements): a chain of 3,000 `$ref`s overflows the stack (SIGSEGV), as does
an EBNF chain of 5,000 rules; `json.loads` of a deeply nested schema raises RecursionError;
`a{1000000000}` in a stop regex makes `regex.compile` allocate until the kernel kills the
process; a 100,000-alternative EBNF takes 30 s. Each check here is a linear scan or an
iterative walk (no recursion, so it cannot itself run out of stack), and each limit is named
in the message so the client knows what to change.

The limits are generous for real schemas (OpenAI documents 5,000 properties, 10 levels of
nesting and 1,000 enum values as its own structured-output maxima) and well inside what the
compiler survives on its dedicated thread (engine/grammar.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

__all__ = [
    "MAX_ALLOF_PATTERNS",
    "MAX_EBNF_BYTES",
    "MAX_EBNF_NESTING",
    "MAX_EBNF_RULES",
    "MAX_JSON_DEPTH",
    "MAX_PATTERN_PROPERTIES",
    "MAX_REGEX_BYTES",
    "MAX_REGEX_NESTING",
    "MAX_REGEX_REPEAT",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_NODES",
    "MAX_SCHEMA_REFS",
    "ebnf_problem",
    "json_depth",
    "json_schema_problem",
    "regex_problem",
    "stop_regex_problem",
]

#: A json_schema's size in UTF-8 bytes. A schema with OpenAI's maximum of 5,000 properties is
#: about 250 KB.
MAX_SCHEMA_BYTES = 1 << 20
#: Nesting of JSON objects and arrays in a json_schema: llguidance's own JSON parser stops at
#: 128 (serde_json's limit), so nothing it could compile is refused; checked first, by a linear
#: scan, so that Python's `json.loads` never recurses deeper than this.
MAX_JSON_DEPTH = 128
#: JSON objects and arrays in a json_schema (OpenAI's 5,000 properties take about 5,000).
#: With MAX_SCHEMA_REFS it bounds how deep the compiler recurses: the deepest schema within
#: both (1,000 `$ref`s chained, 10 objects each) needs 16-24 MiB of stack (20,000 needed
#: 32-48 MiB), against the compile threads' 256 MiB.
MAX_SCHEMA_NODES = 10_000
#: `$ref`s in a json_schema. A chain of 3,000 crashed the compiler on an 8 MiB stack; real
#: schemas use tens.
MAX_SCHEMA_REFS = 1_000
#: A regex (the `regex` grammar, a schema's `pattern`, each `stop_regex`), UTF-8 bytes.
MAX_REGEX_BYTES = 16 << 10
#: Groups inside groups in a regex (Rust's regex parser stops at 250, and at 83 for `(a)*`).
MAX_REGEX_NESTING = 64
#: What a regex spells out once counted repetitions are expanded: `a{1000}` is 1,000,
#: `(ab){10}{3}`-style nesting multiplies. The `regex` package expands them when compiling
#: (about 270 bytes each: `a{1000000000}` exhausted memory), and llguidance's lexer builds
#: them when it first computes a mask (`a{1000000}` took 0.3-1.4 s).
MAX_REGEX_REPEAT = 10_000
#: `pattern`s that constrain one string together (through `allOf`, `$ref`s followed): the
#: compiler intersects them, in time and memory exponential in their number (an `allOf` of 16
#: patterns like `.*a.*b` took 0.7 s and 216 MB, 20 took 24 s and 2.35 GB; up to 12, 20 ms).
MAX_ALLOF_PATTERNS = 8
#: `patternProperties` of one object (64 compiled in 0.01 s, 128 in 0.09 s, 500 in 28 s).
MAX_PATTERN_PROPERTIES = 64
#: An ebnf grammar's size in UTF-8 bytes (100,000 alternatives, 1 MB, took 30 s).
MAX_EBNF_BYTES = 128 << 10
#: Rules in an ebnf grammar (a chain of 5,000 crashed the compiler on an 8 MiB stack, and
#: converting GBNF to Lark is quadratic in chained rules).
MAX_EBNF_RULES = 1_000
#: Parentheses inside parentheses in an ebnf grammar (the GBNF converter recurses in Python).
MAX_EBNF_NESTING = 64

#: A JSON string, or an unterminated one to the end of the text: it always matches at a quote,
#: so cutting strings out is one linear pass even for text that is not JSON.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INLINE_FLAGS = re.compile(r"\(\?([a-zA-Z0-9^-]*)[:)]")
_REPEAT = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")
_BRACED_ESCAPE = re.compile(r"[pPxNuUgk]\{[^}]{0,64}\}|[pP][A-Za-z]")
_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)")
#: Keys whose string value is a regex llguidance compiles.
_REGEX_KEYS = ("pattern", "whitespace_pattern")


def json_depth(text: str) -> int:
    """How deeply objects and arrays nest in `text` (JSON), without parsing it: strings are
    cut out, then the bracket depth is a running sum (numpy, so a megabyte takes
    milliseconds). For text that is not JSON the answer is a bound, good enough to refuse."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def json_schema_problem(text: str) -> str | None:
    """Why `text` (a json_schema) is refused before compiling, or None. Invalid JSON is
    left for the caller's parser to name."""
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        return f"the schema is {size} bytes, over the limit of {MAX_SCHEMA_BYTES} bytes"
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        return (
            f"nested too deeply: {depth} levels of objects and arrays, "
            f"over the limit of {MAX_JSON_DEPTH}"
        )
    try:
        schema = json.loads(text)
    except ValueError:
        return None  # the caller reports it, with the parser's own words
    return schema_value_problem(schema)


def schema_value_problem(schema: Any) -> str | None:
    """The count bounds for a parsed schema (at most MAX_JSON_DEPTH deep), walked iteratively."""
    nodes = refs = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            nodes += 1
            for key, item in value.items():
                if key == "$ref":
                    refs += 1
                elif key in _REGEX_KEYS and isinstance(item, str):
                    if problem := regex_problem(item):
                        return f"{key} {_short(item)}: {problem}"
                elif key == "patternProperties" and isinstance(item, dict):
                    if len(item) > MAX_PATTERN_PROPERTIES:
                        return (
                            f"an object has {len(item)} patternProperties, over the limit of "
                            f"{MAX_PATTERN_PROPERTIES}"
                        )
                    for pattern in item:
                        if problem := regex_problem(pattern):
                            return f"patternProperties {_short(pattern)}: {problem}"
                if isinstance(item, (dict, list)):
                    stack.append(item)
        elif isinstance(value, list):
            nodes += 1
            stack.extend(v for v in value if isinstance(v, (dict, list)))
        if nodes > MAX_SCHEMA_NODES:
            return (
                f"the schema has more than {MAX_SCHEMA_NODES} objects and arrays "
                f"(limit {MAX_SCHEMA_NODES})"
            )
        if refs > MAX_SCHEMA_REFS:
            return f"the schema has more than {MAX_SCHEMA_REFS} $refs (limit {MAX_SCHEMA_REFS})"
    return _allof_problem(schema)


def _allof_problem(root: Any) -> str | None:
    """Whether some `allOf` makes more than MAX_ALLOF_PATTERNS patterns constrain one value:
    a node's patterns are its own `pattern`, and those of its `allOf` members and of the
    schema its local `$ref` points to, followed transitively (each schema counted once, a
    cycle adding nothing). One post-order pass over a schema within the node bound."""
    counts: dict[int, int] = {}  # id(schema) -> its patterns (at most the limit + 1)
    allofs: list[dict[str, Any]] = []
    stack: list[Any] = [root]
    while stack:  # every dict with an allOf
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("allOf"), list):
                allofs.append(value)
            stack.extend(v for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (dict, list)))
    for node in allofs:
        work: list[tuple[dict[str, Any], bool]] = [(node, False)]
        while work:
            schema, children_done = work.pop()
            parts = _conjuncts(root, schema)
            if children_done:
                own = 1 if isinstance(schema.get("pattern"), str) else 0
                total = own + sum(counts.get(id(p), 0) for p in parts)
                counts[id(schema)] = min(total, MAX_ALLOF_PATTERNS + 1)
                continue
            if id(schema) in counts:
                continue
            counts[id(schema)] = 0  # in progress: a cycle back here adds nothing
            work.append((schema, True))
            work.extend((p, False) for p in parts if id(p) not in counts)
        if counts[id(node)] > MAX_ALLOF_PATTERNS:
            return (
                f"an allOf makes more than {MAX_ALLOF_PATTERNS} patterns constrain one value "
                f"(limit {MAX_ALLOF_PATTERNS}; the compiler intersects them)"
            )
    return None


def _conjuncts(root: Any, schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The schemas `schema` is intersected with: its `allOf` members and its `$ref`'s target."""
    parts = [p for p in schema.get("allOf", ()) if isinstance(p, dict)]
    ref = schema.get("$ref")
    if isinstance(ref, str) and (target := _resolve(root, ref)) is not None:
        parts.append(target)
    return parts


def _resolve(root: Any, ref: str) -> dict[str, Any] | None:
    """The schema a local `$ref` ("#", "#/$defs/a~1b") points to, or None."""
    if not ref.startswith("#"):
        return None
    from urllib.parse import unquote

    node = root
    for token in ref[1:].split("/")[1:] if ref != "#" else ():
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node if isinstance(node, dict) else None


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` is refused before compiling, or None: its size, its nesting, or what its
    counted repetitions expand to. One left-to-right scan (Python's and Rust's syntax alike:
    escapes, classes, groups, alternation, `{m}`, `{m,}`, `{m,n}`); a pattern that is not a
    valid regex is left for the compiler to name."""
    size = len(pattern.encode())
    if size > MAX_REGEX_BYTES:
        return f"the regex is {size} bytes, over the limit of {MAX_REGEX_BYTES} bytes"
    # Per open group: [what it spells out so far, what its last item spells out].
    groups: list[list[int]] = [[0, 0]]
    depth = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        top = groups[-1]
        if c == "\\":
            braced = _BRACED_ESCAPE.match(pattern, i + 1)
            i = braced.end() if braced else i + 2
            top[0] += 1
            top[1] = 1
            continue
        if c == "[":
            i = _class_end(pattern, i)
            top[0] += 1
            top[1] = 1
            continue
        if c == "(":
            groups.append([0, 0])
            depth = max(depth, len(groups) - 1)
            if depth > MAX_REGEX_NESTING:
                return (
                    f"groups nested more than {MAX_REGEX_NESTING} deep (limit {MAX_REGEX_NESTING})"
                )
            i += 1
            continue
        if c == ")" and len(groups) > 1:
            inner = groups.pop()[0]
            groups[-1][0] += inner
            groups[-1][1] = inner
            i += 1
            continue
        if c == "|":
            top[1] = 0
            i += 1
            continue
        if c == "{" and (m := _REPEAT.match(pattern, i)) and (m.group(1) or m.group(3)):
            low, _, high = m.groups()
            digits = high or low  # {m}, {m,}: m; {m,n}, {,n}: n
            count = int(digits) if len(digits) <= 9 else MAX_REGEX_REPEAT + 1
            if count > MAX_REGEX_REPEAT:
                return f"a repetition count of {digits} is over the limit of {MAX_REGEX_REPEAT}"
            extra = top[1] * max(count - 1, 0)
            top[0] += extra
            top[1] += extra
            if top[0] > MAX_REGEX_REPEAT:
                return (
                    f"its counted repetitions expand to more than {MAX_REGEX_REPEAT} items "
                    f"(limit {MAX_REGEX_REPEAT})"
                )
            i = m.end()
            continue
        if c not in "*+?":
            top[0] += 1
            top[1] = 1
        i += 1
    return None


def stop_regex_problem(pattern: str) -> str | None:
    """Why `pattern` (a `stop_regex`, compiled by the `regex` package) is refused, or None:
    regex_problem's bounds, and first the forms the `regex` package parses differently from
    regex_problem's scan, which would let a repetition past it (`[[]a{1000000000}]`: to the
    `regex` package a class holding "[" then `a{1000000000}`; `(?x)a{ 1000000000 }`;
    parentheses inside `(?#...)` comments)."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "(" and pattern.startswith("(?", i):
            if pattern.startswith("(?#", i):
                return "comments (?#...) are not supported in stop_regex"
            if flags := _INLINE_FLAGS.match(pattern, i):
                if "x" in flags.group(1):
                    return "verbose mode (the x flag) is not supported in stop_regex"
                if "V" in flags.group(1):
                    return "the V0/V1 flags are not supported in stop_regex"
        if c == "[":
            i += 1
            if i < n and pattern[i] == "^":
                i += 1
            if i < n and pattern[i] == "]":
                i += 1  # a "]" right at the start is a member
            while i < n and pattern[i] != "]":
                if pattern[i] == "\\":
                    i += 1
                elif pattern[i] == "[":
                    return (
                        "a '[' inside a character class is not supported in stop_regex "
                        "(write it as '\\[')"
                    )
                i += 1
        i += 1
    return regex_problem(pattern)


def ebnf_problem(text: str) -> str | None:
    """Why `text` (an ebnf grammar) is refused before compiling, or None."""
    size = len(text.encode())
    if size > MAX_EBNF_BYTES:
        return f"the grammar is {size} bytes, over the limit of {MAX_EBNF_BYTES} bytes"
    rules = len(_RULE.findall(text))
    if rules > MAX_EBNF_RULES:
        return f"the grammar has {rules} rules, over the limit of {MAX_EBNF_RULES}"
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i = _literal_end(text, i)
            continue
        if c == "[":
            i = _class_end(text, i)
            continue
        if c == "%" and text.startswith("%json", i):
            # llguidance's Lark directive that embeds a JSON schema, past json_schema's bounds
            # (as a directive: outside literals and classes).
            return "%json is not supported in an ebnf grammar; send the schema as json_schema"
        if c == "(":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_EBNF_NESTING:
                return (
                    f"parentheses nested more than {MAX_EBNF_NESTING} deep "
                    f"(limit {MAX_EBNF_NESTING})"
                )
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return None


def _class_end(text: str, i: int) -> int:
    """The index after the character class opening at `text[i]` ("["), nested classes and
    escapes included; the end of the text if it never closes."""
    depth, i, n = 0, i, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            depth += 1
            i += 1
            # A "]" (after an optional "^") right at the start is a member, not the end.
            if i < n and text[i] == "^":
                i += 1
            if i < n and text[i] == "]":
                i += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return n


def _literal_end(text: str, i: int) -> int:
    """The index after the quoted literal opening at `text[i]`."""
    i, n = i + 1, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return n


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")
