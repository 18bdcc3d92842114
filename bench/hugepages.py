"""Decode speed by how the weights are paged: mapped from the GGUF (llama.cpp's default and
`tributary serve --mmap`), read into 4 KiB pages of the process's own, and read into huge
pages (Tributary's default, engine/runners/hugepages.py).

    .venv/bin/python bench/hugepages.py [--tokens 200] [--repeats 12] [--concurrency 1 16]

The three copies of the model are loaded in one process, each with a context like the
runner's, and a plain greedy decode loop (no scheduler) runs on each in turn, every copy in
every place of the order in turn, since these machines are noisy. Each copy must produce the same
tokens. Writes docs/benchmarks/hugepages.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tributary.engine import EngineConfig
from tributary.engine.runners.llama import default_model_path, load_model

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "hugepages.json"
PROMPT = "Write a short essay about {}, its history, its people and what comes next. "


def read_in_small_pages(path: Path) -> object:
    params = llama_cpp.llama_model_default_params()
    params.use_extra_bufts = False
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    return llama_cpp.llama_model_load_from_file(str(path).encode(), params)


class Loop:
    """One model copy with a context as the runner makes it (a KV stream per slot)."""

    def __init__(self, model: object, concurrency: int) -> None:
        self.model, self.concurrency = model, concurrency
        vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = 1024 * concurrency
        params.n_seq_max = concurrency
        params.n_batch = params.n_ubatch = 256
        params.n_threads = params.n_threads_batch = os.cpu_count() or 1
        params.kv_unified = False
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        self.batch = llama_cpp.llama_batch_init(256, 0, 1)
        self.prompts = []
        for i in range(concurrency):
            text = (PROMPT.format(f"topic {i}") * 3).encode()
            buf = (llama_cpp.llama_token * 256)()
            n = llama_cpp.llama_tokenize(vocab, text, len(text), buf, 256, True, True)
            self.prompts.append(list(buf[:n]))

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)

    def _put(self, n: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        b.token[n], b.pos[n], b.n_seq_id[n], b.logits[n] = token, pos, 1, logits
        b.seq_id[n][0] = seq

    def _argmax(self, idx: int) -> int:
        row = llama_cpp.llama_get_logits_ith(self.ctx, idx)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.n_vocab,))))

    def run(self, tokens: int) -> tuple[float, list[list[int]]]:
        """Output tokens/s of the decodes after the prompts, and the tokens."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        last, pos = [], []
        for s, prompt in enumerate(self.prompts):
            for p, token in enumerate(prompt):
                self._put(p, token, p, s, p == len(prompt) - 1)
            self.batch.n_tokens = len(prompt)
            assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
            last.append(self._argmax(len(prompt) - 1))
            pos.append(len(prompt))
        out: list[list[int]] = [[] for _ in self.prompts]
        start = time.perf_counter()
        for _ in range(tokens):
            for s in range(self.concurrency):
                self._put(s, last[s], pos[s], s, True)
            self.batch.n_tokens = self.concurrency
            assert llama_cpp.llama_decode(self.ctx, self.batch) == 0
            for s in range(self.concurrency):
                last[s] = self._argmax(s)
                out[s].append(last[s])
                pos[s] += 1
        return tokens * self.concurrency / (time.perf_counter() - start), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=12, help="a multiple of 6: every order")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = p.parse_args()
    path = default_model_path()
    mapped, _ = load_model(path, EngineConfig(mmap_weights=True))
    small = read_in_small_pages(path)
    huge, pages = load_model(path, EngineConfig())
    assert pages is not None
    if pages.error:
        sys.exit(f"the weights are not in huge pages: {pages.error}")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    print(f"transparent_hugepage/enabled: {thp}")
    print(f"huge pages: {pages.huge >> 20} MiB of {pages.advised >> 20} MiB")
    arms = {
        "mapped (4 KiB, page cache)": mapped,
        "read, 4 KiB pages": small,
        "read, huge pages": huge,
    }
    rows = []
    for c in args.concurrency:
        loops = {name: Loop(model, c) for name, model in arms.items()}
        for loop in loops.values():
            loop.run(8)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in loops}
        names = list(loops)
        for r in range(args.repeats):
            outputs = []
            # Every arm takes every place in turn: forward and backward rotations.
            turn = names[r % len(names) :] + names[: r % len(names)]
            for name in turn if r // len(names) % 2 == 0 else turn[::-1]:
                rate, out = loops[name].run(args.tokens)
                rates[name].append(rate)
                outputs.append(out)
            assert all(o == outputs[0] for o in outputs), "the copies decoded different tokens"
            print(f"c={c} repeat {r}: " + "  ".join(f"{n} {v[-1]:.1f}" for n, v in rates.items()))
        for loop in loops.values():
            loop.close()
        base = rates[names[0]]
        for name in names:
            ratios = [x / b for x, b in zip(rates[name], base, strict=True)]
            rows.append(
                {
                    "concurrency": c,
                    "weights": name,
                    "tokens_per_s": round(statistics.median(rates[name]), 1),
                    "vs_mapped": round(statistics.median(ratios), 3),
                    "faster_than_mapped": sum(x > 1 for x in ratios),
                    "runs": [round(x, 1) for x in rates[name]],
                }
            )
    print()
    print("| concurrency | weights | output tok/s | / mapped (median) | repeats faster |")
    print("|---:|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['concurrency']} | {row['weights']} | {row['tokens_per_s']} | "
            f"{row['vs_mapped']} | {row['faster_than_mapped']}/{args.repeats} |"
        )
    OUT.write_text(
        json.dumps(
            {
                "benchmark": "decode speed by how the weights are paged",
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "model": path.name,
                "tokens": args.tokens,
                "repeats": args.repeats,
                "statistic": "median",
                "huge_pages": {"advised": pages.advised, "huge": pages.huge, "error": pages.error},
                "transparent_hugepage_enabled": thp,
                "machine": {
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "kernel": platform.release(),
                },
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
