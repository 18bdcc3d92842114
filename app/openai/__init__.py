"""The OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) on top
of the same engine streams and cancellation as `/generate`. Import names from here.

Synopsis::

    from tributary.app.openai import openai_blueprint

    quart_app.register_blueprint(openai_blueprint(eng, settings))   # create_app does this

Modules: `protocol` parses bodies (`messages` the chat messages, `response_format` the
structured-output option), `served` holds the model and the pre-submit checks,
`chat_template` renders the GGUF template, `choices` drains unary requests and counts usage,
`streaming` sends chunks over SSE, `logprobs` shapes token scores, `completions`/`chat` shape
each endpoint, `errors` the error bodies, `routes` the blueprint.
"""

from .chat_template import ChatTemplate as ChatTemplate
from .errors import InvalidRequest as InvalidRequest
from .errors import ModelNotFound as ModelNotFound
from .errors import NoChatTemplate as NoChatTemplate
from .protocol import ChatRequest as ChatRequest
from .protocol import CompletionRequest as CompletionRequest
from .protocol import parse_chat as parse_chat
from .protocol import parse_completion as parse_completion
from .routes import openai_blueprint as openai_blueprint
from .served import ServedModel as ServedModel
