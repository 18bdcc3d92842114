# Tributary's tasks. `just serve` and `just test` set up .venv first when it is missing or
# older than pyproject.toml.

python := env_var_or_default("PYTHON", "python3")
venv := ".venv"
stamp := venv + "/.tributary-installed"

# List the recipes.
default:
    @just --list

# Create .venv and install Tributary with its test extras (compiles llama.cpp on first run, ~5 min).
# Where pip's llama.cpp has AMX compiled in, swap it for one without (bench/llama_wheel.py: built
# once per machine into ~/.cache/tributary/wheels, 5-10 min on 2 cores; then seconds).
setup:
    test -x {{venv}}/bin/python || {{python}} -m venv {{venv}}
    {{venv}}/bin/python -m pip install --quiet --upgrade pip
    {{venv}}/bin/python -m pip install --quiet -e '.[test]'
    {{venv}}/bin/python bench/llama_wheel.py
    touch {{stamp}}

# Layers then go to the GPU (`--n-gpu-layers auto`). CUDA_ARCH picks the GPUs built for (default:
# the ones in this machine; 90 for H100/H200). AMX stays off, as in bench/peers.py's builds.
# Rebuild .venv's llama-cpp-python with CUDA (needs nvcc and cmake; ~5 min on 16 cores).
setup-cuda: _ensure-setup
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native} -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' '-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    {{venv}}/bin/python -m pip install --force-reinstall --no-deps --no-cache-dir \
        --no-binary llama-cpp-python "llama-cpp-python==$({{venv}}/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
    {{venv}}/bin/python -c 'import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), "built without a GPU backend"; print("llama.cpp with GPU offload")'

# Run setup only when .venv is missing or pyproject.toml changed since the last install.
_ensure-setup:
    @if [ ! -f {{stamp}} ] || [ pyproject.toml -nt {{stamp}} ]; then just setup; fi

# Serve SmolLM2 (or --model-path) on port 30000; extra flags go to `tributary serve`.
serve *FLAGS: _ensure-setup
    {{venv}}/bin/tributary serve {{FLAGS}}

# Run the test suite; extra arguments go to pytest.
test *ARGS: _ensure-setup
    {{venv}}/bin/python -m pytest {{ARGS}}

# ruff (lint and format check) and mypy.
lint: _ensure-setup
    {{venv}}/bin/ruff check app engine tributary tests bench
    {{venv}}/bin/ruff format --check app engine tributary tests bench
    @just _typecheck

# mypy sees the installed layout (`tributary.app`, `tributary.engine`) through a git-ignored
# view of symlinks: it cannot follow setuptools' package-dir mapping of app/ and engine/.
_typecheck:
    rm -rf .lint && mkdir -p .lint/tributary
    for f in tributary/*; do ln -s "../../$f" .lint/tributary/; done
    ln -s ../../app .lint/tributary/app && ln -s ../../engine .lint/tributary/engine
    cd .lint && ../{{venv}}/bin/mypy --config-file ../pyproject.toml

# Run the benchmarks; results go to docs/benchmarks/.
bench: _ensure-setup
    {{venv}}/bin/python bench/engine.py

# Side by side over HTTP: Tributary, llama-server, llama_cpp.server (docs/benchmarks/serving.md);
# `--workloads fresh repeated repetitive`: Tributary's variants and llama-server on three workloads
# (docs/benchmarks/serving-workloads.md; no llama_cpp.server, so it is not set up).
bench-serving *ARGS: _ensure-setup
    python3 bench/peers.py build-llama-server
    case " {{ARGS}} " in *" --workloads "*) ;; *) python3 bench/peers.py setup-llama-cpp-server;; esac
    {{venv}}/bin/python bench/serving.py {{ARGS}}

# API overhead (zero-cost sim runner) against a bare Quart-Trio route (docs/benchmarks/overhead.md).
bench-overhead *ARGS: _ensure-setup
    {{venv}}/bin/python bench/overhead.py {{ARGS}}

# Instructions per request under callgrind, this tree against a git ref (needs valgrind), e.g.
# `just bench-instructions --base origin/main` (docs/benchmarks/instructions.md).
bench-instructions *ARGS: _ensure-setup
    {{venv}}/bin/python bench/instructions.py {{ARGS}}

# What /metrics collection costs: zero-cost sim server with metrics on and off, alternating
# rounds (docs/benchmarks/metrics-overhead.md).
bench-metrics *ARGS: _ensure-setup
    {{venv}}/bin/python bench/metrics_overhead.py {{ARGS}}

# `tributary bench` against aiperf on the same workload, alternating (docs/benchmarks/crosscheck.md).
bench-crosscheck *ARGS: _ensure-setup
    python3 bench/peers.py setup-aiperf
    {{venv}}/bin/python bench/crosscheck.py {{ARGS}}

# Prefix cache and forked n > 1 on the real model: cold vs warm TTFT, forked vs expanded
# (docs/benchmarks/prefix-cache.md); e.g. `just bench-prefix-cache --rounds 9` on a quiet machine.
bench-prefix-cache *ARGS: _ensure-setup
    {{venv}}/bin/python bench/prefix_cache.py {{ARGS}}

# Prefix reuse on the real model: greedy divergence of --prefix-reuse any vs exact vs cold on a
# fixed corpus, and repeated prompts' TTFT (docs/benchmarks/prefix-reuse.md).
bench-prefix-reuse *ARGS: _ensure-setup
    {{venv}}/bin/python bench/prefix_reuse.py {{ARGS}}

# N-gram speculative decoding on the real model: greedy divergence from plain decoding,
# acceptance rate and decode tokens/s at concurrency 1, on and off alternating, on a fixed
# corpus (docs/benchmarks/speculative.md).
bench-speculative *ARGS: _ensure-setup
    {{venv}}/bin/python bench/speculative.py {{ARGS}}

# SmolLM2's Q4_1 and requantized Q4_0, Q4_K_M, IQ4_NL copies; a few minutes.
# Weight repacking on and off, alternating: batch invariance, prefill and decode tokens/s (docs/benchmarks/repack.md).
bench-repack *ARGS: _ensure-setup
    {{venv}}/bin/python bench/repack.py {{ARGS}}

# Disconnect soak on the real model: 2 rounds of 500 requests, 40% of clients leaving early (docs/benchmarks/soak.md).
bench-soak *ARGS: _ensure-setup
    {{venv}}/bin/python bench/soak.py {{ARGS}}

# A front over sim workers against one worker directly: added latency at concurrency 16, the
# front's ceiling over zero-cost workers, and the OpenAI kind over llama-server if built
# (docs/benchmarks/scale-out.md).
bench-scale-out *ARGS: _ensure-setup
    {{venv}}/bin/python bench/scale_out.py {{ARGS}}
