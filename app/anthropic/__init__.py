"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the same engine
streams, chat template and cancellation as `/v1/chat/completions`. Import names from here.

Synopsis::

    from tributary.app.anthropic import anthropic_blueprint

    quart_app.register_blueprint(anthropic_blueprint(eng, settings))   # create_app does this

Modules: `models` declares the request bodies, `protocol` parses them into template messages
and sampling, `served` holds the model and the pre-submit checks, `reply` folds the output
into Anthropic's message (stop reason, usage), `streaming` sends Anthropic's events,
`messages` shapes each endpoint, `errors` the error bodies, `routes` the blueprint, `openapi`
what /openapi.json says of it.

This package imports neither `app/openai` nor `app/sglang`, and neither imports it.
"""

from .errors import anthropic_error_response as anthropic_error_response
from .models import SCHEMAS as SCHEMAS
from .openapi import REQUIRED as REQUIRED
from .openapi import RESPONSES as RESPONSES
from .openapi import anthropic_paths as anthropic_paths
from .routes import MESSAGES_PATH as MESSAGES_PATH
from .routes import anthropic_blueprint as anthropic_blueprint
