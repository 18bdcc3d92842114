"""Tributary's generation engine: continuous batching over llama.cpp, embeddable in any Trio
program. Import names from here, not from the modules.

Synopsis::

    from tributary import engine

    async with engine.open_engine(engine.EngineConfig()) as eng:
        params = engine.SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 32})
        async with eng.submit(engine.GenerateRequest(text="Hi", sampling=params)) as stream:
            async for item in stream:
                ...
"""

import importlib.metadata

from .capabilities import CacheService as CacheService
from .capabilities import Capabilities as Capabilities
from .capabilities import FleetService as FleetService
from .capabilities import PassthroughService as PassthroughService
from .capabilities import RelayedAnswer as RelayedAnswer
from .capabilities import TokenizerService as TokenizerService
from .config import EngineConfig as EngineConfig
from .config import SimLatency as SimLatency
from .core import Engine as Engine
from .core import open_engine as open_engine
from .errors import BadRequest as BadRequest
from .errors import ContextLengthExceeded as ContextLengthExceeded
from .errors import DuplicateRequestId as DuplicateRequestId
from .errors import EngineClosed as EngineClosed
from .errors import EngineError as EngineError
from .errors import GrammarCompilerBusy as GrammarCompilerBusy
from .errors import InvalidSamplingParams as InvalidSamplingParams
from .errors import NotSupported as NotSupported
from .errors import QueueFull as QueueFull
from .errors import RequestTruncated as RequestTruncated
from .errors import RunnerFailure as RunnerFailure
from .errors import WorkerFailure as WorkerFailure
from .interface import EngineLoad as EngineLoad
from .interface import EngineService as EngineService
from .models import DEFAULT_MODEL as DEFAULT_MODEL
from .models import MODELS as MODELS
from .models import ModelNotInstalled as ModelNotInstalled
from .request import HEALTH_CHECK_PREFIX as HEALTH_CHECK_PREFIX
from .request import TERMINAL as TERMINAL
from .request import Done as Done
from .request import EngineStats as EngineStats
from .request import Error as Error
from .request import FinishReason as FinishReason
from .request import Frame as Frame
from .request import GenerateRequest as GenerateRequest
from .request import LogprobRequest as LogprobRequest
from .request import Logprobs as Logprobs
from .request import ModelInfo as ModelInfo
from .request import Output as Output
from .request import SpecCounts as SpecCounts
from .request import TokenLogprob as TokenLogprob
from .request import TopLogprobs as TopLogprobs
from .request import WorkerStats as WorkerStats
from .sampling import SamplingParams as SamplingParams
from .stream import OutputSender as OutputSender
from .stream import RequestStream as RequestStream
from .stream import collect_redirected as collect_redirected
from .stream import open_output_channel as open_output_channel
from .stream import wait_by as wait_by

# One source for the version: pyproject.toml, read back from the installed metadata.
try:
    __version__ = importlib.metadata.version("tributary")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
