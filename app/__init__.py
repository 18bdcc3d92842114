"""Tributary's HTTP front end: SGLang's native `/generate` API and OpenAI's `/v1` on Quart-Trio
and Hypercorn. Import names from here, not from the modules.

Synopsis::

    import tributary

    async with tributary.open_engine(tributary.EngineConfig()) as eng:
        async with tributary.open_http_server(eng, tributary.ServerSettings(port=0)) as urls:
            ...                                  # POST {urls[0]}/generate

`tributary serve` (`tributary.app.cli:main`) does the same from the command line.
"""

from .heap import settle_heap as settle_heap
from .observe.timing import RequestTiming as RequestTiming
from .routes import create_app as create_app
from .server import ServerConfig as ServerConfig
from .server import open_http_server as open_http_server
from .server import serve as serve
from .settings import ServerSettings as ServerSettings
from .state import ServerState as ServerState
from .state import server_state as server_state
