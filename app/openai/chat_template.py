"""`ChatTemplate`: a GGUF's `tokenizer.chat_template`, rendered the way llama-cpp-python does.

Synopsis::

    template = ChatTemplate.for_engine(eng)          # None when the model has no template
    prompt = template.render([{"role": "user", "content": "Hi"}])
    ids = eng.tokenize(prompt, add_special=False)    # the template already wrote BOS, if any

The environment matches llama-cpp-python's `Jinja2ChatFormatter` (itself aligned with
Hugging Face transformers): a sandboxed `ImmutableSandboxedEnvironment` with `trim_blocks`
and `lstrip_blocks`, the `loopcontrols` extension, a pass-through `{% generation %}` tag, a
`tojson` filter that keeps non-ASCII text, and the globals `messages`, `bos_token`,
`eos_token`, `add_generation_prompt`, `raise_exception` and `strftime_now`. The rendered
text is tokenized without adding special tokens, so a template that writes `bos_token` does
not get a second BOS.

A template that calls `raise_exception` (for example "roles must alternate") or fails while
rendering is the request's fault: `render` raises `InvalidRequest` with the template's message.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tributary.engine import EngineService

from .errors import InvalidRequest

__all__ = ["ChatTemplate"]


class _TemplateRaised(Exception):
    pass


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}` marks training targets; for
    inference it is a pass-through."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, *, bos_token: str, eos_token: str) -> None:
        """Compile `source`. Raises `jinja2.TemplateSyntaxError` for a broken template."""
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = env.from_string(source)

    @classmethod
    def for_engine(cls, engine: EngineService) -> ChatTemplate | None:
        """The engine's model template, with its BOS and EOS token texts; None if it has none."""
        info = engine.model_info
        if not info.chat_template:
            return None
        # ModelInfo names every end-of-generation token but not which one is *the* EOS; until
        # it does (`eos_token_id`), a template that writes eos_token gets "", as
        # llama-cpp-python gives a model without one.
        eos_id = getattr(info, "eos_token_id", None)
        return cls(
            info.chat_template,
            bos_token=_token_text(engine, info.bos_token_id),
            eos_token=_token_text(engine, eos_id),
        )

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=messages,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                raise_exception=_raise_exception,
                strftime_now=_strftime_now,
            )
        except _TemplateRaised as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                f"The model's chat template failed on these messages: {exc}", param="messages"
            ) from None


def _token_text(engine: EngineService, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return engine.detokenize([token_id], skip_special_tokens=False)
