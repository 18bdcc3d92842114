"""Weight repacking on and off, side by side: greedy batch invariance, and prefill and decode
tokens/s, for the default SmolLM2 (Q4_1) and copies of it requantized by llama.cpp.

    .venv/bin/python bench/repack.py [--rounds 3] [--quants Q4_1 Q4_0 Q4_K_M IQ4_NL]

Needs a llama.cpp without AMX (`just setup`): an AMX build refuses to repack. The copies are
made with llama.cpp's own `llama_model_quantize` from the Q4_1 file (requantized, so below
the quality of a Q4_0 made from f16, which matters neither for speed nor for invariance) in
a temporary folder. Per model, both sides are loaded as the engine loads them (`load_weights`,
`new_context`: one KV stream per sequence, the engine's thread count) and driven by a bare
`llama_decode` loop with greedy argmax, so the kernels are all that differs:

- invariance: 8 chat prompts, each prefilled and decoded alone, then all 8 prefilled in one
  decode and decoded together (8 rows a step); a prompt whose greedy tokens differ breaks
  batch invariance. Also the largest logit difference while the tokens still agree, and how
  many prompts decode the same tokens with and without repacking.
- prefill: one ~250-token prompt in one decode; prompt tokens / s.
- decode: 1 and 8 sequences, `--tokens` steps; output tokens / s.

`--threads` defaults to every core, as the engine does; on a busy shared machine
`--threads 1` keeps OpenMP's barrier waits out of the figures (the run in
docs/benchmarks/repack.md used it, at a load average of 5-7 on 2 cores). The speed
measurements alternate between the sides, the order swapping every round (these
machines are shared and noisy: only side by side means anything). Prints a table; writes
docs/benchmarks/repack.json and repack.md with the machine (CPU model, its avx2/avx512*/amx*
flags, cores) and llama.cpp's build.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tributary.engine import EngineConfig
from tributary.engine.repack import AMX_MARK, choose_repack
from tributary.engine.runners.llama import default_model_path
from tributary.engine.runners.llama.loading import (
    llama_system_info,
    load_weights,
    new_context,
    weight_types,
)

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = [
    "Write a haiku about rain.",
    "Name a fruit.",
    "Why is the sky blue?",
    "Explain what a prime number is.",
    "Give me three tips for sleeping well.",
    "What is the capital of Italy?",
    "Describe a cat in two sentences.",
    "How do airplanes fly?",
]
LONG = (
    "The history of bread begins in the Neolithic, when people first ground wild grains "
    "between stones and baked the paste on hot rocks. Over thousands of years, bakers learned "
    "to leaven dough with wild yeasts, to build ovens of clay and brick, and to mill flour "
    "ever finer. "
) * 4

QUANTS = {
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "IQ4_NL": llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL,
}
CONTEXT = 512
SLOTS = 8


def quantized_copy(name: str, folder: Path) -> Path:
    """The default model requantized to `name` by llama.cpp (Q4_1: the file itself)."""
    source = default_model_path()
    if name == "Q4_1":
        return source
    out = folder / source.name.replace(".Q4_1.", f".{name}.")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANTS[name]
    params.allow_requantize = True  # the source is already quantized
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {name} failed ({rc})")
    return out


class Side:
    """One model loaded repacked or not, with a context as the engine makes it."""

    def __init__(self, path: Path, repack: bool, threads: int) -> None:
        config = EngineConfig(
            model_path=str(path),
            context_length=CONTEXT,
            max_running_requests=SLOTS,
            repack_weights=repack,
        )
        loaded = load_weights(path, config)
        self.model, self.repack = loaded.model, loaded.repack
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.ctx = new_context(
            self.model, config, kv_cells=config.kv_cells(CONTEXT), n_batch=512, threads=threads
        )
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 2))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, True)
        return list(buf[:n])

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """One llama_decode of (seq, pos, token, wants logits) rows; the logits asked for."""
        b = self.batch
        for n, (seq, pos, token, logits) in enumerate(rows):
            b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
            b.seq_id[n][0] = seq
        b.n_tokens = len(rows)
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        out = []
        for n, row in enumerate(rows):
            if row[3]:
                ptr = llama_cpp.llama_get_logits_ith(self.ctx, n)
                array = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                              shape=(self.n_vocab,))  # fmt: skip
                out.append(array.copy())
        return out

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.mem, True)

    def greedy(self, prompts: list[list[int]], steps: int) -> list[tuple[list[int], list[Any]]]:
        """All prompts prefilled in one decode and decoded together: per prompt its tokens
        and the logits each came from."""
        rows = [(s, p, t, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in
                enumerate(ids)]  # fmt: skip
        logits = self.decode(rows)
        out: list[tuple[list[int], list[Any]]] = [([], []) for _ in prompts]
        for step in range(steps):
            for s, row in enumerate(logits):
                out[s][0].append(int(np.argmax(row)))
                out[s][1].append(row)
            if step == steps - 1:
                break
            logits = self.decode(
                [(s, len(ids) + step, out[s][0][-1], True) for s, ids in enumerate(prompts)]
            )
        self.clear()
        return out

    def prefill_rate(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.decode([(0, p, t, p == len(ids) - 1) for p, t in enumerate(ids)])
        elapsed = time.perf_counter() - start
        self.clear()
        return len(ids) / elapsed

    def decode_rate(self, prompts: list[list[int]], steps: int) -> float:
        self.decode([(s, p, t, p == len(i) - 1) for s, i in enumerate(prompts) for p, t in
                     enumerate(i)])  # fmt: skip
        start = time.perf_counter()
        for step in range(steps):
            self.decode([(s, len(i) + step, 1, True) for s, i in enumerate(prompts)])
        elapsed = time.perf_counter() - start
        self.clear()
        return len(prompts) * steps / elapsed

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)


def invariance(side: Side, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Each prompt alone (1 row) against all 8 together (8 rows), and the first 5 against
    those 5 together (ggml's repacked kernels take rows in fours: 5 mixes its two kernels):
    the prompts whose tokens differ in either, where, and the largest logit difference
    while the tokens agreed."""
    alone = [side.greedy([ids], steps)[0] for ids in prompts]
    pairs = [
        (i, batch, alone[i], out)
        for batch in (len(prompts), 5)
        for i, out in enumerate(side.greedy(prompts[:batch], steps))
    ]
    broken, largest = [], 0.0
    for i, batch, (a_ids, a_logits), (b_ids, b_logits) in pairs:
        for a, b, x, y in zip(a_ids, b_ids, a_logits, b_logits, strict=True):
            largest = max(largest, float(np.max(np.abs(x - y))))
            if a != b:
                break
        if a_ids != b_ids:
            first = next(k for k, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)) if a != b)
            broken.append({"prompt": i, "batch": batch, "first_difference": first})
    return {
        "prompts": len(prompts),
        "prompts_broken": len({b["prompt"] for b in broken}),
        "steps": steps,
        "broken": broken,
        "max_logit_difference": round(largest, 6),
        "alone": [ids for ids, _ in alone],
    }


def measure(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    sides = {repack: Side(path, repack, args.threads) for repack in (False, True)}
    try:
        prompts = [sides[False].tokenize(CHAT.format(q)) for q in QUESTIONS]
        long = sides[False].tokenize(LONG)
        checks = {r: invariance(s, prompts, args.steps) for r, s in sides.items()}
        runs: dict[bool, dict[str, list[float]]] = {
            r: {"prefill": [], "decode_1": [], "decode_8": []} for r in sides
        }
        for s in sides.values():
            s.decode_rate(prompts[:1], 4)  # warm-up
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for r in order:
                runs[r]["prefill"].append(sides[r].prefill_rate(long))
            for r in order:
                runs[r]["decode_1"].append(sides[r].decode_rate(prompts[:1], args.tokens))
            for r in order:
                runs[r]["decode_8"].append(sides[r].decode_rate(prompts, args.tokens))
        repack = sides[True].repack
    finally:
        for s in sides.values():
            s.close()
    row: dict[str, Any] = {
        "model": path.name,
        "quant": path.name.split(".")[-2],
        "prefill_tokens": len(long),
        "weight_types": sorted(weight_types(path)),
        "auto_repacks": choose_repack(
            "auto", llama_system_info(), weight_types(path), platform.machine()
        ).enabled,
        "repacked_mib": round(repack.repacked_mib, 1),
        "buffers_mib": dict(repack.buffers),
        "same_tokens_on_and_off": sum(
            a == b for a, b in zip(checks[False]["alone"], checks[True]["alone"], strict=True)
        ),
    }
    for r, name in ((False, "off"), (True, "on")):
        checks[r].pop("alone")
        row[f"invariance_{name}"] = checks[r]
        for key, values in runs[r].items():
            row[f"{key}_{name}_runs"] = [round(x, 1) for x in values]
            row[f"{key}_{name}"] = round(statistics.median(values), 1)
    for key in ("prefill", "decode_1", "decode_8"):
        # Each round's on / off (measured back to back), then their median: steadier than
        # the ratio of the medians when the machine's load drifts during the run.
        pairs = zip(runs[True][key], runs[False][key], strict=True)
        row[f"{key}_ratio"] = round(statistics.median(on / off for on, off in pairs), 3)
    return row


def machine(threads: int) -> dict[str, Any]:
    model, flags = "", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            if key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    wanted = [f for f in flags if f == "avx2" or f.startswith(("avx512", "amx", "avx_vnni"))]
    return {
        "cpu": model or platform.processor(),
        "cpu_flags": sorted(wanted),
        "cores": os.cpu_count(),
        "threads": threads,
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_system_info().strip(),
    }


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Weight repacking on and off",
        "",
        f"`just bench-repack` on {result['when']}: {m['cpu']}, {m['cores']} cores "
        f"({m['threads']} thread{'s' if m['threads'] != 1 else ''}; load average "
        f"{m['load_average_at_start']} at the start), "
        f"flags {' '.join(m['cpu_flags'])}; llama-cpp-python {m['llama_cpp_python']} "
        f"(`{m['llama_cpp_system_info']}`). Tokens/s: medians of {result['rounds']} "
        f"alternating rounds, the ratios (in brackets) medians of each round's on / off "
        f"(prefill: one {result['results'][0]['prefill_tokens']}-token prompt; decode: "
        f"{result['tokens']} steps). Invariance: {len(QUESTIONS)} chat prompts, "
        f"{result['steps']} greedy tokens each, alone against all {len(QUESTIONS)} together and "
        "the first 5 together.",
        "",
        "| model | `auto` repacks | repacked | prefill tok/s off / on | decode 1 seq off / on | "
        "decode 8 seqs off / on | prompts batch-invariant off / on "
        "(largest logit difference) | same tokens on and off |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        inv = {
            s: f"{r[f'invariance_{s}']['prompts'] - r[f'invariance_{s}']['prompts_broken']}/"
            f"{r[f'invariance_{s}']['prompts']} ({r[f'invariance_{s}']['max_logit_difference']:g})"
            for s in ("off", "on")
        }
        lines.append(
            f"| {r['quant']} | {'yes' if r['auto_repacks'] else 'no'} | "
            f"{r['repacked_mib']} MiB | {r['prefill_off']} / {r['prefill_on']} "
            f"({r['prefill_ratio']}x) | {r['decode_1_off']} / {r['decode_1_on']} "
            f"({r['decode_1_ratio']}x) | {r['decode_8_off']} / {r['decode_8_on']} "
            f"({r['decode_8_ratio']}x) | {inv['off']} / {inv['on']} | "
            f"{r['same_tokens_on_and_off']}/{len(QUESTIONS)} |"
        )
    lines += ["", "Reading it:", ""]
    for r in result["results"]:
        on, off = r["invariance_on"], r["invariance_off"]
        if not r["repacked_mib"]:
            lines.append(
                f"- {r['quant']}: llama.cpp repacked none of its tensors "
                f"({', '.join(r['weight_types'])}), so both sides run the same kernels: their "
                "difference is the run's noise."
            )
            continue
        said = f"- {r['quant']}: {r['repacked_mib']} MiB repacked; "
        for name, check in (("repacked", on), ("unrepacked", off)):
            if check["prompts_broken"]:
                said += (
                    f"{name}, {check['prompts_broken']} of {check['prompts']} prompts decoded "
                    "other tokens beside others than alone (logits up to "
                    f"{check['max_logit_difference']:.2f} apart); "
                )
            elif check["max_logit_difference"]:
                said += (
                    f"{name}, every prompt decoded the same tokens alone and beside others "
                    f"(logits up to {check['max_logit_difference']:.2g} apart); "
                )
            else:
                said += f"{name}, every prompt decoded the same logits alone and beside others; "
        verdict = "repacks it" if r["auto_repacks"] else "leaves it unrepacked"
        lines.append(f"{said}`auto` {verdict}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="decode steps measured")
    parser.add_argument("--steps", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--quants", nargs="+", default=["Q4_1", "Q4_0", "Q4_K_M", "IQ4_NL"])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if AMX_MARK in llama_system_info():
        sys.exit("this llama.cpp was compiled with AMX, which cannot repack: run `just setup`")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    info = machine(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="repack-") as tmp:
        for quant in args.quants:
            rows.append(measure(quantized_copy(quant, Path(tmp)), args))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "benchmark": "weight repacking on and off",
        "when": started,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "steps": args.steps,
        "statistic": "median",
        "machine": info,
        "results": rows,
    }
    text = markdown(result)
    print(text)
    if not args.no_write:
        (OUT / "repack.json").write_text(json.dumps(result, indent=2) + "\n")
        (OUT / "repack.md").write_text(text)
        print(f"wrote {OUT / 'repack.json'} and repack.md")


if __name__ == "__main__":
    main()
