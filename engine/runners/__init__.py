"""Model runners: `llama` (llama.cpp, the default) and `sim` (deterministic, for tests)."""
