"""`tributary serve` in a subprocess on the real model, for the grammar-bomb tests
(test_grammar_bombs.py, test_grammar_fuzz.py): a crash of the compiler kills that process,
not the test run, and the test can see it (`Served.alive`).

`served()` starts one server; `served_front()` starts two workers and a front over them
(`--worker-url`); `check_serving()` checks that servers are alive and still answer a grammar
request. `TOOL_SCHEMA` is a tool call as OpenAI clients define one (also used by
bench/grammar_containment.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

STARTUP = re.compile(r"Tributary serving .* at (http://\S+)")

#: Small and single-threaded: another process may hold one of the machine's two cores.
MODEL_FLAGS = ("--context-length", "1024", "--max-running-requests", "4", "--threads", "1")

#: A tool call as OpenAI clients define one (nested parameters, $defs, anyOf, patterns).
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "book_flight"},
        "arguments": {
            "type": "object",
            "properties": {
                "from": {"$ref": "#/$defs/airport"},
                "to": {"$ref": "#/$defs/airport"},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "passengers": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/passenger"},
                    "minItems": 1,
                    "maxItems": 9,
                },
                "cabin": {"anyOf": [{"enum": ["economy", "business"]}, {"type": "null"}]},
            },
            "required": ["from", "to", "date", "passengers"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "$defs": {
        "airport": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passenger": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
            "required": ["name"],
        },
    },
}

#: Seconds a cheap grammar request may take on a server whose compile slots are free.
CHEAP_GRAMMAR_TIME = 3.0


@dataclasses.dataclass
class Served:
    """A `tributary serve` subprocess and the URL it serves."""

    proc: subprocess.Popen[bytes]
    url: str
    stderr: Path

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def why_dead(self) -> str:
        """The exit status (a negative one is the signal) and the end of stderr."""
        code = self.proc.poll()
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else code
        return f"exited with {how}: {self.stderr.read_text(errors='replace')[-2000:]}"


@contextlib.contextmanager
def served(*flags: str, startup_timeout: float = 120) -> Iterator[Served]:
    """`tributary serve --port 0 *flags` (the real model unless flags say otherwise), stopped
    with SIGINT (then SIGKILL) on exit."""
    with tempfile.NamedTemporaryFile(prefix="tributary-serve-", suffix=".log") as log:
        command = [sys.executable, "-m", "tributary", "serve", "--port", "0", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, env=env)
        try:
            served = Served(
                proc, _startup_url(proc, startup_timeout, Path(log.name)), Path(log.name)
            )
            yield served
        finally:
            _stop(proc)


@contextlib.contextmanager
def served_front(*worker_flags: str) -> Iterator[tuple[Served, list[Served]]]:
    """Two workers (`served(*worker_flags)`) and a front over them."""
    with served(*worker_flags) as one, served(*worker_flags) as two:
        urls = [arg for w in (one, two) for arg in ("--worker-url", w.url)]
        with served(*urls, "--log-level", "warning") as front:
            yield front, [one, two]


def check_serving(client: httpx.Client, *processes: Served) -> None:
    """Every process is alive, `/health` answers, and a cheap grammar request is served within
    CHEAP_GRAMMAR_TIME (a compile thread or checker held by an earlier request would show)."""
    for proc in processes:
        assert proc.alive, proc.why_dead()
    assert client.get("/health").status_code == 200
    start = time.monotonic()
    ok = client.post(
        "/generate",
        json={"text": "Is it?", "sampling_params": {"max_new_tokens": 4, "regex": "(yes|no)"}},
    )
    took = time.monotonic() - start
    assert ok.status_code == 200 and ok.json()["text"] in ("yes", "no"), ok.text
    assert took < CHEAP_GRAMMAR_TIME, took


def _startup_url(proc: subprocess.Popen[bytes], timeout: float, log: Path) -> str:
    assert proc.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    out = b""
    while b"\n" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"tributary serve did not start: {out!r} {log.read_text()[-2000:]}")
        if selector.select(min(left, 1.0)):
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                continue
            out += chunk
    selector.close()
    match = STARTUP.search(out.decode(errors="replace"))
    if not match:
        raise RuntimeError(f"no startup line: {out!r}")
    # Keep reading stdout so the server never blocks on a full pipe.
    threading.Thread(target=_drain, args=(proc,), daemon=True).start()
    return match.group(1)


def _drain(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    while os.read(proc.stdout.fileno(), 65536):
        pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
