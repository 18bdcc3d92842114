"""The llama.cpp runner: one context, one sequence id per running request (and a second
context for embeddings, made on first use).

Synopsis::

    runner = await compute_thread().run(LlamaRunner.load, config, orphan=LlamaRunner.close)

Built on llama-cpp-python's low-level bindings (`llama_batch`, `llama_decode`, per-sequence
KV removal, one C sampler chain per request). Facts it relies on, measured on these machines
(docs/architecture.md):

- Weight repacking (`use_extra_bufts`) makes every decode segfault when llama.cpp was
  compiled with AMX, and Q4_K's repacked kernels break batch invariance; Q4_0's and
  IQ4_NL's keep it and prefill 1.4-1.6 times as fast. So `repack_weights="auto"` repacks
  unless either holds (engine/repack.py decides; `loading.load_weights` reads the build and
  the GGUF's tensor types and logs one line). SmolLM2's Q4_1 has nothing to repack.
- ctypes releases the GIL during `llama_decode`, so a step runs in another thread and the
  event loop keeps serving HTTP meanwhile. That thread is always the same one
  (`ComputeThread`, engine/compute_thread.py): llama.cpp is built with OpenMP here, and a
  second OpenMP team halves decode speed.
- `llama_set_abort_callback` would stop every sequence in the shared context, so aborted
  sequences are dropped between steps instead (the scheduler's job); the callback is used
  only at shutdown, to give up the decode in flight (`decode_stop`).

Each slot has its own KV stream of `context_length` cells (`kv_unified = False`). A shared
pool would fit more short requests in the same memory, but it breaks batch invariance: with
one pool, a sequence's attention sums run over cells at offsets that depend on the other
sequences, and greedy output then changes with the batch (measured: 2 of 5 chat prompts
diverged within 48 tokens when run beside copies of themselves; none with split streams).
The price of split streams: llama.cpp cuts a batch into one graph per run of consecutive
sequence ids, so the batch goes in id order and the scheduler hands out the lowest free slot.

`LlamaRunner` is one object over one context, its state touched on the compute thread; its
methods are grouped by job, one module each, each a layer of the class:

- `loading`: from a GGUF path to a model and a context (huge pages, memory, metadata);
- `devices`: where the layers go: the GPUs llama.cpp sees, the GGUF's layer sizes, the plan;
- `vocabulary`: tokens, pieces, and llguidance's view of the vocabulary;
- `kv`: KV snapshots, restores and the per-slot cell count;
- `sampler`: sampler chains and sampling from zero-copy views of the logits;
- `step`: a step's decodes (prompt chunks, scoring, forks) and the decode launched ahead;
- `decode_run`: a run of decodes in one compute-thread job;
- `embed`: embeddings, in a second context of their own over the same model;
- `decode_stop`: giving up a decode midway when the engine closes (not a layer: a helper);
- `runner`: the facade the scheduler calls (`Runner` in engine/runners/base.py).
"""

from .kv import LlamaKVState
from .loading import MAX_GRAPH_TOKENS, batch_tokens, default_model_path, graph_tokens, load_model
from .runner import LlamaRunner

__all__ = [
    "MAX_GRAPH_TOKENS",
    "LlamaKVState",
    "LlamaRunner",
    "batch_tokens",
    "default_model_path",
    "graph_tokens",
    "load_model",
]
