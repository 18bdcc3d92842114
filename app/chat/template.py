"""`ChatTemplate`: a GGUF's `tokenizer.chat_template`, rendered the way llama-cpp-python does.

Synopsis::

    template = ChatTemplate.for_engine(eng)          # None when the model has no template
    prompt = template.render([{"role": "user", "content": "Hi"}])
    ids = eng.tokenize(prompt, add_special=False)    # the template already wrote BOS, if any

The environment matches llama-cpp-python's `Jinja2ChatFormatter` (itself aligned with
Hugging Face transformers): a sandboxed `ImmutableSandboxedEnvironment` with `trim_blocks`
and `lstrip_blocks`, the `loopcontrols` extension, a pass-through `{% generation %}` tag, a
`tojson` filter that keeps non-ASCII text, and the globals `messages`, `bos_token`,
`eos_token`, `add_generation_prompt`, `tools` and `documents` (None unless given),
`raise_exception` and `strftime_now`. tests/app/test_chat_templates_reference.py checks that
the templates of Llama 3.x, Qwen 2.5/3, Gemma 3, Mistral, Phi-3.5/4 and SmolLM2 render here
exactly as transformers' `apply_chat_template` renders them. The rendered
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

from tributary.engine import EngineService, TokenizerService
from tributary.engine.offload import INLINE_WORK, SPECIAL_WEIGHT, off_loop, work

from ..http.errors import InvalidRequest

__all__ = ["ChatTemplate", "render_prompt_ids"]

#: Chats up to this many messages (and `offload.INLINE_WORK` of work) are rendered and
#: tokenized on the event loop; larger ones in a worker thread.
INLINE_MESSAGES = 16

#: What the template adds to the work for each message, in `offload.work`'s characters:
#: the two special tokens a template writes around a message (`<|im_start|>`, `<|im_end|>`)
#: and jinja's own time.
MESSAGE_WORK = 2 * SPECIAL_WEIGHT + 40


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
        """The engine's model template, with its BOS and EOS token texts; None if it has none
        (or if the engine has no tokenizer to turn it into ids: a front's workers render)."""
        info = engine.model_info
        if not info.chat_template or not isinstance(engine, TokenizerService):
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

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """`tools` is Hugging Face's `tools=` (OpenAI's `{"type": "function", "function":
        {...}}` entries); `extra` the request's `chat_template_kwargs` (and `reasoning_effort`),
        in scope beside the globals, as `apply_chat_template(**kwargs)` puts them. A template
        that fails with `tools` is tried once more with the bare function entries (SGLang's
        fallback: Mistral's templates expect those)."""
        try:
            try:
                return self._render(messages, add_generation_prompt, tools, extra)
            except (jinja2.TemplateError, TypeError, ValueError, _TemplateRaised):
                if not tools:
                    raise
                bare = [tool.get("function", tool) for tool in tools]
                return self._render(messages, add_generation_prompt, bare, extra)
        except _TemplateRaised as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        except Exception as exc:  # jinja's errors, and Python's (`1 / 0`)
            raise InvalidRequest(
                f"The model's chat template failed on these messages: {exc}", param="messages"
            ) from None

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        extra: dict[str, Any] | None,
    ) -> str:
        context: dict[str, Any] = {**extra} if extra else {}
        if tools is not None:
            context["tools"] = tools
        # As transformers' apply_chat_template: both always defined, None when absent, so a
        # template's `tools is defined` / `documents is none` read the same as there.
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        return self._template.render(
            context,
            messages=messages,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=add_generation_prompt,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
        )


async def render_prompt_ids(
    template: ChatTemplate,
    tokenizer: TokenizerService,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> list[int]:
    """The ids of `messages` rendered by `template`, tokenized without adding special tokens
    (the template writes them). A short chat is done on the event loop; a long one (up to
    `messages.MAX_MESSAGES`) in a worker thread (`offload.off_loop`), since jinja and the
    tokenizer take time in proportion to it. `tools` and `extra` as `ChatTemplate.render`
    takes them (their strings count in the work)."""

    def render_and_tokenize() -> list[int]:
        text = template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, extra=extra
        )
        return tokenizer.tokenize(text, add_special=False)

    work: list[Any] = messages if tools is None and extra is None else [*messages, tools, extra]
    if len(messages) <= INLINE_MESSAGES and _chat_work(work) <= INLINE_WORK:
        return render_and_tokenize()
    return await off_loop(render_and_tokenize)


def _chat_work(messages: list[Any]) -> int:
    """What rendering and tokenizing `messages` costs (`offload.work`): every string the
    template may render (content, name, any other field), and MESSAGE_WORK a message."""
    total = len(messages) * MESSAGE_WORK
    pending: list[object] = list(messages)
    while pending and total <= INLINE_WORK:
        value = pending.pop()
        if isinstance(value, str):
            total += work(value) if len(value) <= INLINE_WORK else len(value)
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return total


def _token_text(engine: TokenizerService, token_id: int | None) -> str:
    if token_id is None:
        return ""
    return engine.detokenize([token_id], skip_special_tokens=False)
