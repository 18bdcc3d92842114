"""The compute thread's stack does not depend on the process's defaults (issue 30's crash:
llama.cpp's tokenizer set-up faulted on the compute thread of a CUDA build).

llama.cpp's std::regex pre-tokenizers recurse once per character of a match (measured with
its deepseek-llm vocabulary: a 10,000-letter word overflows 2 MiB, 40,000 letters 8 MiB), and
a thread's default stack is 2 MiB under `ulimit -s unlimited`, 128 KiB with musl, or whatever
`threading.stack_size` says when the thread starts."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
import threading

import pytest
import trio

from tributary.engine.compute_thread import STACK_BYTES, ComputeThread, thread_stack_bytes

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the stack with glibc's pthread_getattr_np"
)


def test_the_compute_thread_gets_its_own_stack_whatever_threading_stack_size_says() -> None:
    previous = threading.stack_size(256 << 10)
    try:
        thread = ComputeThread()
        assert threading.stack_size() == 256 << 10  # the process's setting is left as it was
    finally:
        threading.stack_size(previous)
    stack = trio.run(thread.run, thread_stack_bytes)
    assert stack is not None and stack >= STACK_BYTES >= 64 << 20


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_STACK)[1] != resource.RLIM_INFINITY,
    reason="needs a hard stack limit of unlimited",
)
def test_under_an_unlimited_stack_rlimit_plain_threads_get_2_mib_and_the_compute_thread_more() -> (
    None
):
    """The environment the crash came from may well have run with `ulimit -s unlimited`:
    glibc then gives every new thread 2 MiB. The model loads and tokenizes on the compute
    thread there."""
    script = textwrap.dedent(
        """
        import threading, trio
        from tributary.engine import EngineConfig
        from tributary.engine.compute_thread import compute_thread, thread_stack_bytes
        from tributary.engine.runners.llama import default_model_path, load_model
        import llama_cpp

        plain = []
        t = threading.Thread(target=lambda: plain.append(thread_stack_bytes()))
        t.start(); t.join()

        def load_and_tokenize():
            model, _ = load_model(default_model_path(), EngineConfig(mmap_weights=True))
            vocab = llama_cpp.llama_model_get_vocab(model)
            text = ("word " * 20000).strip().encode()
            ids = (llama_cpp.llama_token * len(text))()
            n = llama_cpp.llama_tokenize(vocab, text, len(text), ids, len(text), False, False)
            llama_cpp.llama_model_free(model)
            return thread_stack_bytes(), n

        stack, n = trio.run(compute_thread().run, load_and_tokenize)
        print(plain[0], stack, n)
        """
    )

    unlimited = 'ulimit -s unlimited && exec "$0" -c "$1"'  # glibc reads it at start-up
    done = subprocess.run(
        ["sh", "-c", unlimited, sys.executable, script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    plain, stack, tokens = (int(x) for x in done.stdout.split())
    assert plain == 2 << 20
    assert stack >= STACK_BYTES
    assert tokens == 20000
