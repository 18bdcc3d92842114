"""Serving from a fleet of upstream workers (SGLang, vLLM, llama.cpp's server or other
Tributary servers): which worker gets a request (`fleet`, `policy`, `attempt`), when a worker
is left alone (`breaker`, `health`), and the engine that forwards to them (`engine`,
`forward`, `passthrough`)."""

from .config import RemoteConfig as RemoteConfig
from .engine import RemoteEngine as RemoteEngine
from .engine import open_remote_engine as open_remote_engine
from .fleet import Fleet as Fleet
from .policy import POLICIES as POLICIES
from .worker import Worker as Worker
from .worker import WorkerKind as WorkerKind
