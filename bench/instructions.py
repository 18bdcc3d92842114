"""Instructions per request on the API path, counted by callgrind: this tree against a git ref.

    .venv/bin/python bench/instructions.py --base REF [--requests 200] [--shapes unary:4 stream:16]

CPU time per request on a small machine shared with other work moves by several per cent
from run to run, more than a change to the request path usually costs. Callgrind counts the
instructions the server executes instead, which repeat to within a few hundredths of a per
cent whatever else the machine is doing. So this is the before/after check for a change that
must not slow the path down; `bench/overhead.py` stays the measure of time.

For each tree (REF, checked out in a temporary git worktree, and this working tree) and each
shape (`unary:4`: a unary `/generate` of 4 greedy tokens; `stream:N`: a streaming one of N;
`v1:N` and `v1-stream:N`: the same on `/v1/completions`),
a zero-cost sim server (as `bench/overhead.py`'s `tributary` server) runs under
`valgrind --tool=callgrind --instr-atstart=no`. One keep-alive connection sends 100 warm-up
requests; instrumentation is switched on for `--requests` sequential requests and off again;
their total over the count is the figure. The trees' servers run side by side (each one is
single-threaded under valgrind). Needs valgrind (Debian's `valgrind`).

Writes docs/benchmarks/instructions.json and instructions.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from overhead import PYTHON, REPO, machine_info, versions
from page_notes import commands_section, existing_notes, page_header, summary_json

DOCS = REPO / "docs" / "benchmarks"
WARMUP = 100

#: Imports Tributary from the shim folder's `tributary/` instead of the editable install.
SITECUSTOMIZE = """\
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path_hooks[:] = [h for h in sys.path_hooks if "editable" not in repr(h).lower()]
sys.path_importer_cache.clear()
"""


def serve(port: int) -> None:
    """The server role (run under valgrind): bench/overhead.py's zero-cost sim server."""
    import trio

    import tributary

    async def main() -> None:
        zero = tributary.SimLatency(step_base=0, decode_per_seq=0, prefill_per_token=0)
        config = tributary.EngineConfig(runner="sim", sim_latency=zero, max_running_requests=64)
        async with tributary.open_engine(config) as eng:
            settings = tributary.ServerSettings(port=port, log_level="warning")
            async with tributary.open_http_server(eng, settings):
                tributary.settle_heap()
                print("serving", flush=True)
                await trio.sleep_forever()

    trio.run(main)


def shim(tree: Path, into: Path) -> Path:
    """A folder whose `tributary` package is `tree`'s (app/, engine/, tributary/*)."""
    package = into / "tributary"
    package.mkdir(parents=True)
    for entry in (tree / "tributary").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "app").symlink_to(tree / "app")
    (package / "engine").symlink_to(tree / "engine")
    (into / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return into


def request_bytes(kind: str, tokens: int) -> bytes:
    """One request of a shape: `unary`/`stream` (`/generate`) or `v1`/`v1-stream`
    (`/v1/completions`), greedy, `tokens` tokens whatever the sim samples (`ignore_eos`)."""
    stream = kind.endswith("stream")
    if kind.startswith("v1"):
        path = "/v1/completions"
        fields = {"prompt": "Hi there", "max_tokens": tokens, "temperature": 0}
        body = {**fields, "ignore_eos": True, "stream": stream}
    else:
        path = "/generate"
        sampling = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        body = {"text": "Hi there", "sampling_params": sampling, "stream": stream}
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


def requests(port: int, n: int, kind: str, tokens: int) -> None:
    """`n` sequential requests of a shape on one keep-alive connection, each read whole."""
    raw = request_bytes(kind, tokens)
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as f:
        for _ in range(n):
            sock.sendall(raw)
            status = f.readline()
            if b" 200 " not in status:
                raise RuntimeError(f"the server answered {status!r}")
            length = None
            while (line := f.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if length is not None:
                f.read(length)
                continue
            while size := int(f.readline().strip(), 16):  # chunked
                f.read(size + 2)
            f.readline()


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def count(shim_dir: Path, port: int, shape: str, n: int, work: Path) -> int:
    """Instructions the server executed over `n` requests of `shape`, after the warm-up."""
    kind, _, tokens = shape.partition(":")
    out = work / f"callgrind.{port}"
    env = dict(os.environ, PYTHONPATH=str(shim_dir), PYTHONHASHSEED="0")
    proc = subprocess.Popen(
        [
            *("valgrind", "--tool=callgrind", "--instr-atstart=no"),
            f"--callgrind-out-file={out}",
            *(str(PYTHON), __file__, "_serve", str(port)),
        ],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "serving":
            raise RuntimeError(f"the server under valgrind did not start ({shim_dir})")
        tokens_n = int(tokens)
        requests(port, WARMUP, kind, tokens_n)
        control(proc.pid, "-i", "on")
        requests(port, n, kind, tokens_n)
        control(proc.pid, "-i", "off")
        control(proc.pid, "-d")
        time.sleep(2)  # the dump is written by the server's next scheduling
    finally:
        proc.kill()
        proc.wait()
    total = 0
    for path in work.glob(f"callgrind.{port}*"):
        for line in path.read_text().splitlines():
            if line.startswith("totals:"):
                total += int(line.split()[1])
    if not total:
        raise RuntimeError(f"callgrind recorded nothing for {shape} ({shim_dir})")
    return total


def measure(base: str, shapes: list[str], n: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="tributary-instr-") as tmp:
        work = Path(tmp)
        base_tree = work / "base-tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), base],
            check=True,
            capture_output=True,
        )
        try:
            shims = {
                "base": shim(base_tree, work / "shim-base"),
                "this": shim(REPO, work / "shim-this"),
            }
            rows = []
            for i, shape in enumerate(shapes):
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    futures = {
                        tree: pool.submit(count, shims[tree], 31800 + 2 * i + j, shape, n, work)
                        for j, tree in enumerate(("base", "this"))
                    }
                    got = {tree: f.result() / n for tree, f in futures.items()}
                rows.append(
                    {
                        "shape": shape,
                        "base_per_request": round(got["base"]),
                        "this_per_request": round(got["this"]),
                        "change_pct": round((got["this"] / got["base"] - 1) * 100, 2),
                    }
                )
                print(
                    f"{shape:>10}  {rows[-1]['base_per_request']:>12,}  "
                    f"{rows[-1]['this_per_request']:>12,}  {rows[-1]['change_pct']:+6.2f} %",
                    flush=True,
                )
            return rows
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                check=False,
                capture_output=True,
            )


def write_page(doc: dict[str, Any], argv: str) -> None:
    md = DOCS / "instructions.md"
    notes = existing_notes(md)
    lines = page_header(
        "Instructions per request (callgrind)",
        script="bench/instructions.py",
        recipe="just bench-instructions",
        raw="instructions.json",
        doc=doc,
        notes=notes,
    )
    # The shared header speaks of rounds of alternating servers; here one run of both trees.
    lines = [
        line.replace("; 1 rounds, the two servers alternating.", "; both trees side by side.")
        for line in lines
    ]
    config = doc["config"]
    dirty = " with uncommitted changes" if config["dirty"] else ""
    lines += [
        f"Base: `{config['base']}` ({config['base_commit'][:10]}); this tree: "
        f"{config['this_commit'][:10]}{dirty}. "
        f"{config['requests']} requests per figure, after {WARMUP} warm-up requests.",
        "",
        "| shape | base instructions/request | this tree | change |",
        "|---|---:|---:|---:|",
    ]
    for row in doc["rows"]:
        lines.append(
            f"| {row['shape']} | {row['base_per_request']:,} | {row['this_per_request']:,} "
            f"| {row['change_pct']:+.2f} % |"
        )
    lines += commands_section("just bench-instructions", "bench/instructions.py", argv)
    md.write_text("\n".join(lines))
    (DOCS / "instructions.json").write_text(summary_json(doc))


def git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":
        serve(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git ref to compare against")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["unary:4", "stream:16", "stream:64", "v1:4", "v1-stream:16"],
        help="KIND:TOKENS, KIND one of unary, stream (/generate), v1, v1-stream (/v1/completions)",
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench/instructions.py needs valgrind (apt install valgrind)")
    print(f"{'shape':>10}  {'base':>12}  {'this tree':>12}  change", flush=True)
    rows = measure(args.base, args.shapes, args.requests)
    doc = {
        "date": datetime.date.today().isoformat(),
        "machine": machine_info(),
        "versions": versions(),
        "config": {
            "base": args.base,
            "base_commit": git("rev-parse", args.base),
            "this_commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "requests": args.requests,
            "rounds": 1,
        },
        "rows": rows,
    }
    write_page(doc, " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
