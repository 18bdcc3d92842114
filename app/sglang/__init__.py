"""SGLang's native API (`/generate`, the endpoints around it, `/tokenize`) on top of the
engine's streams. Import names from here.

Synopsis::

    from tributary.app.sglang import add_sglang_routes

    add_sglang_routes(quart_app, eng, state)   # create_app does this

Modules: `protocol` declares the request bodies, `normalize` turns a `/generate` body into
engine requests, `generate` submits and drains them, `output` shapes SGLang's response
objects, `stream` sends them over SSE, `errors` the error bodies, `admin` the endpoints
around `/generate` (`health` its shared `/health_generate` probe), `tokenize` `/tokenize` and
`/detokenize`, `routes` puts them on the app.
"""

from .normalize import NormalizedGenerate as NormalizedGenerate
from .normalize import normalize_generate as normalize_generate
from .routes import add_sglang_routes as add_sglang_routes
