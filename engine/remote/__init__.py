"""Serving from a fleet of upstream workers (SGLang, vLLM, llama.cpp's server or other
Tributary servers): which worker gets a request (`fleet`, `policy`), when a worker is left
alone (`breaker`, `health`), and the engine that forwards to them."""
