"""Tributary: an LLM serving front end on Trio's structured concurrency.

SGLang's native `/generate` API and OpenAI's API over a continuous-batching engine on
llama.cpp. Installed, the project claims only this name; `tributary.engine` (generation) and
`tributary.app` (HTTP) live below it, and the names a program needs are re-exported here.

Synopsis::

    import tributary

    async with tributary.open_engine(tributary.EngineConfig()) as eng:
        async with tributary.open_http_server(eng, tributary.ServerSettings(port=0)) as urls:
            ...                                  # POST {urls[0]}/generate

`tributary serve` (or `python -m tributary serve`) does the same from the command line.
"""

from tributary.app import RequestTiming as RequestTiming
from tributary.app import ServerConfig as ServerConfig
from tributary.app import ServerSettings as ServerSettings
from tributary.app import create_app as create_app
from tributary.app import open_http_server as open_http_server
from tributary.app import serve as serve
from tributary.app import settle_heap as settle_heap
from tributary.engine import BadRequest as BadRequest
from tributary.engine import ContextLengthExceeded as ContextLengthExceeded
from tributary.engine import Done as Done
from tributary.engine import DuplicateRequestId as DuplicateRequestId
from tributary.engine import Engine as Engine
from tributary.engine import EngineClosed as EngineClosed
from tributary.engine import EngineConfig as EngineConfig
from tributary.engine import EngineError as EngineError
from tributary.engine import EngineStats as EngineStats
from tributary.engine import Error as Error
from tributary.engine import FinishReason as FinishReason
from tributary.engine import Frame as Frame
from tributary.engine import GenerateRequest as GenerateRequest
from tributary.engine import GrammarCompilerBusy as GrammarCompilerBusy
from tributary.engine import InvalidSamplingParams as InvalidSamplingParams
from tributary.engine import LogprobRequest as LogprobRequest
from tributary.engine import Logprobs as Logprobs
from tributary.engine import ModelInfo as ModelInfo
from tributary.engine import Output as Output
from tributary.engine import QueueFull as QueueFull
from tributary.engine import RequestStream as RequestStream
from tributary.engine import RequestTruncated as RequestTruncated
from tributary.engine import RunnerFailure as RunnerFailure
from tributary.engine import SamplingParams as SamplingParams
from tributary.engine import SimLatency as SimLatency
from tributary.engine import __version__ as __version__
from tributary.engine import open_engine as open_engine
