"""The OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) on top
of the same engine streams and cancellation as `/generate`. Import names from here.

Synopsis::

    from tributary.app.openai import openai_blueprint

    quart_app.register_blueprint(openai_blueprint(eng, settings))   # create_app does this

Modules: `models` declares the request bodies, `protocol` parses them (`app/chat` the chat
messages, `response_format` the
structured-output option), `served` holds the model and the pre-submit checks (the GGUF
template renders in `app/chat`), `choices` drains unary requests and counts usage,
`streaming` sends chunks over SSE, `logprobs` shapes token scores, `completions`/`chat` shape
each endpoint, `errors` the error bodies, `routes` the blueprint.
"""

from .protocol import ChatRequest as ChatRequest
from .protocol import CompletionRequest as CompletionRequest
from .protocol import parse_chat as parse_chat
from .protocol import parse_completion as parse_completion
from .routes import openai_blueprint as openai_blueprint
