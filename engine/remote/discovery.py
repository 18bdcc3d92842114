"""What a front knows of the model it serves: it has none of its own, so it asks a worker.

Synopsis::

    info = await discover_model(client, fleet.workers, timeout=2.0, base=unknown_model("m"))
    name = await openai_model_name(client, worker, timeout=5.0)  # what /v1/completions names

    model = ServedModel(client, fleet, name="remote", served_name=None, timeout=2.0)
    if not await model.ask(log_level=logging.WARNING):
        nursery.start_soon(model.ask_until_answered, 5.0)
    model.info                                                   # what the front serves

Every answer is read within `limit` bytes and every call within `timeout` seconds: a worker
that never answers, or answers without end, costs the front that much and no more.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable
from typing import Any

import httpx
import trio

from ..request import ModelInfo
from .fleet import Fleet
from .wire import AnswerTooLarge, read_limited
from .worker import Worker

__all__ = [
    "INFO_LIMIT",
    "UNKNOWN_CONTEXT",
    "UNKNOWN_VOCAB",
    "ModelUnknown",
    "ServedModel",
    "discover_model",
    "openai_model_name",
    "unknown_model",
]

LOGGER = logging.getLogger("tributary.engine.remote")

#: What the front reports for a model no worker has described (none answered at start):
#: token ids and lengths are then checked by the workers alone.
UNKNOWN_CONTEXT = 1 << 30
UNKNOWN_VOCAB = 1 << 31

#: The most the front reads of a worker's answer about its model (`/v1/models`,
#: `/get_model_info`, `/get_server_info`): a few KiB in practice.
INFO_LIMIT = 1 << 20


class ModelUnknown(Exception):
    """A worker did not say which model it serves (no answer in time, an error, an answer
    without a model). The message is for clients: it names no URL."""


def unknown_model(name: str) -> ModelInfo:
    return ModelInfo(
        name=name,
        path="",
        context_length=UNKNOWN_CONTEXT,
        train_context_length=UNKNOWN_CONTEXT,
        vocab_size=UNKNOWN_VOCAB,
        eos_token_ids=frozenset(),
        eos_token_id=None,
        bos_token_id=None,
        chat_template=None,
    )


class ServedModel:
    """The model the front serves, as its workers describe it (`info`): until one does, a
    model called `served_name` or `name`, with no limits of its own (`unknown_model`)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        fleet: Fleet,
        *,
        name: str,
        served_name: str | None,
        timeout: float,
    ) -> None:
        self._client = client
        self._fleet = fleet
        self._served_name = served_name
        self._timeout = timeout
        self._base = unknown_model(served_name or name)
        self.info = self._base

    async def ask(self, *, log_level: int) -> bool:
        """Ask the workers about the model; whether one answered (else the model stays
        the base: a name of the front's and no limits of its own)."""
        base = self._base
        info = await discover_model(
            self._client,
            self._fleet.workers,
            timeout=self._timeout,
            base=base,
            log_level=log_level,
        )
        if self._served_name:
            info = dataclasses.replace(info, name=self._served_name)
        self.info = info
        return info is not base

    async def ask_until_answered(self, pause: float) -> None:
        """No worker answered at start (workers still loading their model, or none added
        yet): ask again every `pause` seconds until one does, so the model's name (what /v1
        requests must name), context length and vocabulary become the workers' once they
        are up."""
        while not await self.ask(log_level=logging.DEBUG):
            await trio.sleep(pause)
        LOGGER.info("serving %s, as a worker describes it", self.info.name)


async def discover_model(
    client: httpx.AsyncClient,
    workers: Iterable[Worker],
    *,
    timeout: float,
    base: ModelInfo,
    log_level: int = logging.WARNING,
) -> ModelInfo:
    """`base` with what the first worker to answer (within `timeout` each) says of its model
    (`/get_model_info` of an SGLang-kind worker, `/v1/models` of an OpenAI one); `base`
    itself (the same object) if none answers. Never raises for a worker's failure."""
    for worker in workers:
        try:
            with trio.fail_after(timeout):
                info = await _ask(client, worker)
        except (
            httpx.HTTPError,
            ValueError,
            KeyError,
            IndexError,
            TypeError,
            AttributeError,
            AnswerTooLarge,
            trio.TooSlowError,
        ) as exc:
            LOGGER.log(log_level, "no model info from %s: %s", worker.url, exc)
            continue
        return dataclasses.replace(base, **{k: v for k, v in info.items() if v is not None})
    return base


async def openai_model_name(client: httpx.AsyncClient, worker: Worker, *, timeout: float) -> str:
    """The model an OpenAI server serves: the first its `/v1/models` lists. `ModelUnknown`
    unless it answers so within `timeout` seconds."""
    try:
        with trio.fail_after(timeout):
            return str((await _get_json(client, f"{worker.url}/v1/models"))["data"][0]["id"])
    except trio.TooSlowError:
        raise ModelUnknown(f"no answer to /v1/models within {timeout:g} s") from None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AnswerTooLarge) as exc:
        LOGGER.warning("worker %d (%s): no model from /v1/models: %r", worker.id, worker.url, exc)
        raise ModelUnknown("no model named by its /v1/models") from None


async def _get_json(client: httpx.AsyncClient, url: str) -> Any:
    async with client.stream("GET", url) as response:
        response.raise_for_status()
        return json.loads(await read_limited(response.aiter_bytes(), INFO_LIMIT))


async def _ask(client: httpx.AsyncClient, worker: Worker) -> dict[str, Any]:
    if worker.kind == "openai":
        entry = (await _get_json(client, f"{worker.url}/v1/models"))["data"][0]
        length = entry.get("max_model_len")  # vLLM's
        return {
            "name": str(entry["id"]),
            "path": str(entry.get("root") or entry["id"]),
            "context_length": _int(length),
            "train_context_length": _int(length),
        }
    obj = await _get_json(client, f"{worker.url}/get_model_info")
    length = obj.get("context_length")  # Tributary's
    if not isinstance(length, int):
        # SGLang's /get_model_info has no context length; its /get_server_info has the
        # longest prompt it takes (max_req_input_len, one less than the context).
        try:
            longest = (await _get_json(client, f"{worker.url}/get_server_info")).get(
                "max_req_input_len"
            )
        except httpx.HTTPStatusError:
            longest = None
        length = longest + 1 if isinstance(longest, int) else None
    return {
        "name": obj.get("served_model_name") or obj.get("model_path"),
        "path": obj.get("model_path"),
        "context_length": _int(length),
        "train_context_length": _int(length),
        "vocab_size": _int(obj.get("vocab_size")),
    }


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) else None
