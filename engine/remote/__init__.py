"""Serving from remote workers (SGLang, vLLM, Tributary): `open_remote_engine` yields an
`EngineService` whose items are forwarded to a fleet. Import names from here."""

from .engine import RemoteConfig as RemoteConfig
from .engine import RemoteEngine as RemoteEngine
from .engine import open_remote_engine as open_remote_engine
from .fleet import Fleet as Fleet
from .fleet import Worker as Worker
from .fleet import WorkerKind as WorkerKind
from .policy import POLICIES as POLICIES
