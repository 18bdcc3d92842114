"""Chat messages and the model's chat template, shared by OpenAI's `/v1/chat/completions` and
SGLang's `/tokenize`: `messages` checks a `messages` list, `template` renders it with the
GGUF's template into the prompt the model runs; `served` is the served model and the checks
every chat API makes before it submits (`/v1/chat/completions` and `/v1/messages` build on it).
"""

from .template import ChatTemplate as ChatTemplate
