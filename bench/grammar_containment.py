"""What containing the grammar compiler costs a request (issue 33).

    .venv/bin/python bench/grammar_containment.py [--repeats 200]

`Grammars.matcher` checks the bounds (engine/grammar_bounds.py) on the caller's thread,
validates the grammar in a child process (engine/grammar_guard.py; its answer is cached),
then compiles on a compile thread with a 256 MiB stack and waits for it. This measures, for
grammars real clients send, the compile done in place on the calling thread (what the engine
did before) against `matcher()` for a grammar seen for the first time (the checker's cache
cleared: bounds + the child's check + hand-off + the same compile) and for one seen before
(cached: bounds + hand-off + compile), in one process, the three in a rotating order each
repeat (these machines are noisy: only a side-by-side comparison means anything, and rotating
removes any advantage of going first). Also the hand-off alone (an empty job). A request
without a grammar never calls `matcher()`: nothing is added to it. Medians over `--repeats`.
Prints a table; writes docs/benchmarks/grammar-containment.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "app"))
from grammarserver import TOOL_SCHEMA

from tributary.engine import grammar, grammar_guard
from tributary.engine.grammar import Grammars, compile_on_big_stack
from tributary.engine.grammar_bounds import ebnf_problem, json_schema_problem, regex_problem
from tributary.engine.runners.llama import default_model_path, vocabulary

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "grammar-containment.json"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
#: OpenAI's documented maximum of properties (5,000) in one object.
LARGE = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string", "maxLength": 40} for i in range(5000)},
}
GRAMMARS: list[tuple[str, str, str, int]] = [  # (label, kind, source, repeats divisor)
    ("json_schema: person (PERSON_SCHEMA)", "json_schema", json.dumps(PERSON), 1),
    ("json_schema: a tool call with $defs", "json_schema", json.dumps(TOOL_SCHEMA), 1),
    ("json_schema: 5,000 properties", "json_schema", json.dumps(LARGE), 20),
    ("regex: (yes|no)", "regex", "(yes|no)", 1),
    ("regex: a phone number", "regex", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", 1),
    ("ebnf: an answer grammar", "ebnf", 'root ::= "The answer is " ("yes" | "no") "."', 1),
]
BOUNDS = {"json_schema": json_schema_problem, "regex": regex_problem, "ebnf": ebnf_problem}


def lltokenizer() -> tuple[Any, int]:
    """The default model's vocabulary (SmolLM2, 49,152 tokens) without its weights."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(default_model_path()).encode(), params)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    lltokenizer.model = model  # type: ignore[attr-defined]  # keeps the vocab alive
    return vocabulary.lltokenizer(vocab, n_vocab), n_vocab


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    tokenizer, n_vocab = lltokenizer()
    grammars = Grammars(tokenizer, n_vocab)
    compile_on_big_stack(lambda: None)  # start the compile threads
    handoff = []
    for _ in range(args.repeats * 5):
        start = time.perf_counter()
        compile_on_big_stack(lambda: None)
        handoff.append(time.perf_counter() - start)
    rows = []
    for label, kind, source, divisor in GRAMMARS:
        repeats = max(args.repeats // divisor, 6)
        samples: dict[str, list[float]] = {"in_place": [], "first": [], "cached": []}

        def first(kind: str = kind, source: str = source) -> None:
            grammar_guard.clear_cache()
            grammars.matcher(kind, source)

        runs = {
            "in_place": lambda k=kind, s=source: grammars._compile_now(k, s),  # before
            "first": first,
            "cached": lambda k=kind, s=source: grammars.matcher(k, s),
        }
        bounds = []
        for r in range(repeats):
            names = list(runs)
            names = names[r % 3 :] + names[: r % 3]  # rotate the order each repeat
            for name in names:
                if name == "cached":
                    grammars.matcher(kind, source)  # make sure it is in the cache
                start = time.perf_counter()
                runs[name]()
                samples[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            BOUNDS[kind](source)
            bounds.append(time.perf_counter() - start)
        row = {
            "grammar": label,
            "bytes": len(source.encode()),
            "repeats": repeats,
            "in_place_ms": median_ms(samples["in_place"]),
            "first_seen_ms": median_ms(samples["first"]),
            "cached_ms": median_ms(samples["cached"]),
            "bounds_ms": median_ms(bounds),
        }
        row["first_seen_added_ms"] = row["first_seen_ms"] - row["in_place_ms"]
        row["cached_added_ms"] = row["cached_ms"] - row["in_place_ms"]
        rows.append(row)
    result = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "compile_threads": grammar.COMPILE_THREADS,
        "compile_stack_mib": grammar.COMPILE_STACK_BYTES >> 20,
        "checker_processes": grammar_guard.POOL_SIZE,
        "checker_memory_mib": grammar_guard.CHILD_MEMORY_BYTES >> 20,
        "checker_cache": grammar_guard.CACHE_SIZE,
        "handoff_ms": median_ms(handoff),
        "handoff_repeats": len(handoff),
        "no_grammar_added_ms": 0.0,
        "rows": rows,
    }
    print(f"hand-off to a compile thread alone: {result['handoff_ms'] * 1000:.0f} us (median)")
    print("a request without a grammar: nothing added (matcher() is not called)\n")
    columns = ("bytes", "in place", "first seen", "added", "cached", "added", "bounds")
    print(f"{'grammar':38s} " + " ".join(f"{c:>10s}" for c in columns))
    for r in rows:
        times = (
            r["in_place_ms"],
            r["first_seen_ms"],
            r["first_seen_added_ms"],
            r["cached_ms"],
            r["cached_added_ms"],
            r["bounds_ms"],
        )
        print(f"{r['grammar']:38s} {r['bytes']:10d} " + " ".join(f"{t:8.2f}ms" for t in times))
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
