"""`admin_blueprint`: the endpoints around `/generate` that SGLang clients, routers and load
balancers call: `/health`, `/health_generate`, `/get_model_info` (`/model_info`),
`/get_server_info` (`/server_info`), `/get_load`, `/metrics` (unless metrics are disabled),
`/abort_request`, `/flush_cache`, and the worker routes of a front serving a fleet
(`/list_workers`, `/add_worker`, `/remove_worker`: SGLang's model gateway's names).
docs/api.md has the wire details.

A front's worker routes answer only the admin key, and only when one is set
(`--admin-api-key`; without one they are off: 403). Adding a worker sends other users'
prompts to it, and the list names internal addresses: neither is for a plain API key's
holder, nor for anyone who can reach an unkeyed front.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from urllib.parse import urlsplit

import trio
from quart import Blueprint, Response, request

from tributary import engine as engine_pkg
from tributary.engine import (
    HEALTH_CHECK_PREFIX,
    BadRequest,
    Done,
    EngineError,
    EngineService,
    Error,
    GenerateRequest,
    NotSupported,
    QueueFull,
    SamplingParams,
)
from tributary.engine.wire import convert

from ..http.auth import bearer_is
from ..http.body import read_json_body
from ..http.errors import StatusError, Unauthorized, abort_status
from ..http.responses import json_response
from ..observe.metrics import CONTENT_TYPE
from ..state import ServerState
from .health import SharedProbe
from .protocol import AbortBody

__all__ = ["ADMIN_PATHS", "admin_blueprint", "version"]

LOGGER = logging.getLogger("tributary.app")

#: Routes that change what the server is doing (not only read it or generate): with
#: `--admin-api-key` only that key opens them. A new state-changing route belongs here
#: (tests/app/test_admin_auth.py fails for an unclassified one).
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/add_worker", "/remove_worker"})


def version() -> str:
    """The installed package's version (`tributary.engine.__version__`, its one source)."""
    return engine_pkg.__version__


def admin_blueprint(engine: EngineService, state: ServerState) -> Blueprint:
    bp = Blueprint("tributary_admin", __name__)
    settings = state.settings
    cache, fleet = state.capabilities.cache, state.capabilities.fleet

    @bp.route("/health", methods=["GET"])
    async def health() -> Response:
        return Response("", status=503 if state.draining else 200, mimetype="text/plain")

    # One probe in the engine at a time, however many callers (health.py).
    shared_probe = SharedProbe(lambda: _probe(engine, settings.health_check_timeout))

    @bp.route("/health_generate", methods=["GET"])
    async def health_generate() -> Response:
        ok = not state.draining and await shared_probe()
        return Response("", status=200 if ok else 503, mimetype="text/plain")

    @bp.route("/get_model_info", methods=["GET"])
    @bp.route("/model_info", methods=["GET"])
    async def model_info() -> Response:
        info = engine.model_info
        return json_response(
            {
                "model_path": info.path,
                "tokenizer_path": info.path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": settings.weight_version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": None,
                "architectures": None,
                "served_model_name": engine.config.served_model_name or info.name,
                "context_length": info.context_length,
                "vocab_size": info.vocab_size,
            }
        )

    @bp.route("/get_server_info", methods=["GET"])
    @bp.route("/server_info", methods=["GET"])
    async def server_info() -> Response:
        info = engine.model_info
        stats = engine.stats()
        return json_response(
            {
                **_config_fields(engine.config),
                **dataclasses.asdict(settings),
                # Never echo a secret.
                "api_key": "***" if settings.api_key else None,
                "admin_api_key": "***" if settings.admin_api_key else None,
                "port": _bound_port(state.urls) or settings.port,
                "urls": state.urls,
                "model_path": info.path,
                "served_model_name": engine.config.served_model_name or info.name,
                "context_length": info.context_length,
                "max_total_num_tokens": stats.kv_total_cells,
                "max_req_input_len": info.context_length - 1,
                "internal_states": [dataclasses.asdict(stats)],
                # Where the layers and KV cache went (null: no local model, or sim).
                "placement": info.placement.as_json() if info.placement else None,
                # Whether the weights were repacked, and whether llama.cpp has AMX (null: sim).
                "weights_repack": info.weights_repack.as_json() if info.weights_repack else None,
                "version": version(),
            }
        )

    @bp.route("/get_load", methods=["GET"])
    async def get_load() -> Response:
        # SGLang's shape: one object per data-parallel rank; dp_rank (and the request
        # plumbing fields rid, http_worker_ipc) are null on a server without DP, as there.
        load = engine.load()
        return json_response(
            [
                {
                    "rid": None,
                    "http_worker_ipc": None,
                    "dp_rank": None,
                    "num_reqs": load.num_reqs,
                    "num_waiting_reqs": load.num_waiting_reqs,
                    "num_tokens": load.num_tokens,
                }
            ]
        )

    metrics = state.metrics
    if metrics is not None:

        @bp.route("/metrics", methods=["GET"])
        async def metrics_text() -> Response:
            return Response(metrics.render(), status=200, content_type=CONTENT_TYPE)

    @bp.route("/abort_request", methods=["POST"])
    async def abort_request() -> Response:
        body = await read_json_body()
        if not isinstance(body, dict):
            raise BadRequest("The request body must be a JSON object.")
        fields = convert(body, AbortBody, fault=lambda key, value: value)  # worded below
        rid, abort_all = fields.rid, fields.abort_all
        if not isinstance(abort_all, bool):
            raise BadRequest(f"abort_all must be a boolean, got {abort_all!r}.")
        if rid is not None and not isinstance(rid, str):
            raise BadRequest(f"rid must be a string, got {rid!r}.")
        if abort_all:
            engine.abort_all()
        elif rid:  # SGLang ignores an empty rid
            engine.abort(rid, fanout=True)
        return Response("", status=200, mimetype="text/plain")

    @bp.route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        # SGLang's body either way; like SGLang, a busy engine keeps its cache and says 400.
        if cache is None:
            raise NotSupported(NO_CACHE_HERE)
        flushed = cache.flush_cache()
        return Response(FLUSH_CACHE_MESSAGE, status=200 if flushed else 400, mimetype="text/plain")

    def require_worker_admin() -> None:
        """A front's worker routes: the admin key only, and only when there is one. (A
        server with its own model has no workers; its routes answer so to anyone.)"""
        if fleet is None:
            return
        admin_key = settings.admin_api_key
        if not admin_key:
            raise StatusError(403, WORKER_ROUTES_OFF)
        if not bearer_is(admin_key):
            raise Unauthorized("This endpoint manages the workers and needs the admin API key.")

    @bp.route("/list_workers", methods=["GET"])
    async def list_workers() -> Response:
        require_worker_admin()
        workers = fleet.worker_stats() if fleet is not None else []  # none: the model is here
        return json_response({"workers": [dataclasses.asdict(w) for w in workers]})

    @bp.route("/add_worker", methods=["POST"])
    async def add_worker() -> Response:
        require_worker_admin()
        url, kind = await _worker_argument()
        if fleet is None:
            raise BadRequest(NO_WORKERS_HERE)
        try:
            added = fleet.add_worker(url, kind)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return json_response(dataclasses.asdict(added))

    @bp.route("/remove_worker", methods=["POST"])
    async def remove_worker() -> Response:
        require_worker_admin()
        url, _ = await _worker_argument()
        if fleet is None:
            raise BadRequest(NO_WORKERS_HERE)
        try:
            removed = fleet.remove_worker(url)
        except KeyError:
            return json_response({"error": {"message": f"No worker {url}.", "code": 404}}, 404)
        return json_response(dataclasses.asdict(removed))

    return bp


#: `/flush_cache` where the engine has no cache of its own (a front).
NO_CACHE_HERE = "This server fronts a fleet of workers; flush each worker's cache at the worker."

#: The worker routes of a server with its own model. A 400, not a 501: the request is wrong
#: for this server, which could never take it.
NO_WORKERS_HERE = "This server runs its own model; it has no workers (start it with --worker-url)."

#: A front's worker routes without `--admin-api-key`.
WORKER_ROUTES_OFF = (
    "Worker management is off: this server was started without --admin-api-key. Start it "
    "with one to list, add or remove workers at run time (with that key)."
)


async def _worker_argument() -> tuple[str, str]:
    """The worker a route names: `?url=...[&kind=...]` as SGLang's gateway takes it, or a
    JSON body `{"url": ..., "kind": ...}`."""
    url, kind = request.args.get("url"), request.args.get("kind")
    if url is None:
        body = await read_json_body()
        if not isinstance(body, dict):
            raise BadRequest('Name the worker: ?url=... or a JSON body {"url": ...}.')
        url, kind = body.get("url"), body.get("kind", kind)
    if not isinstance(url, str) or not url:
        raise BadRequest("url must be a worker's base URL, e.g. http://10.0.0.5:30000.")
    if kind is None:
        kind = "sglang"
    if kind not in ("sglang", "openai"):
        raise BadRequest(f"kind must be 'sglang' or 'openai', got {kind!r}.")
    return url, kind


def _config_fields(config: object) -> dict[str, object]:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
        # A front's workers are internal addresses: /list_workers (admin key) names them.
        fields.pop("workers", None)
        return fields
    return {}


#: SGLang's `/flush_cache` answer, sent with 200 (flushed) or 400 (requests were running or
#: waiting, so nothing was flushed).
FLUSH_CACHE_MESSAGE = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _bound_port(urls: list[str]) -> int | None:
    return urlsplit(urls[0]).port if urls else None


#: How often a health probe looks for output from other requests.
PROGRESS_POLL = 0.05


async def _probe(engine: EngineService, timeout: float) -> bool:
    """SGLang's health probe: one greedy token from input_ids [0], within `timeout`.

    As in SGLang, any output counts: a busy engine passes as soon as it produces a token for
    anyone, so a full house (or a full queue) never reads as a dead server. The probe's own
    failure, or silence for `timeout`, is a 503.
    """
    tokens_before = engine.stats().generated_tokens
    probe = GenerateRequest(
        input_ids=[0],
        sampling=SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0}),
        rid=f"{HEALTH_CHECK_PREFIX}{uuid.uuid4().hex}",
    )
    stream = None
    try:
        stream = engine.submit(probe)
    except QueueFull:
        pass  # busy, not broken: other requests' progress decides
    except EngineError as exc:
        LOGGER.warning("health probe rejected: %s", exc.message)
        return False
    verdict: list[bool] = []

    async def own_output() -> None:
        assert stream is not None
        async with stream:
            async for item in stream:
                if isinstance(item, Done | Error):
                    ok = isinstance(item, Done) and abort_status(item.finish_reason) is None
                    verdict.append(ok)
                    nursery.cancel_scope.cancel()

    async def anyones_output() -> None:
        while engine.stats().generated_tokens == tokens_before:
            await trio.sleep(PROGRESS_POLL)
        verdict.append(True)
        nursery.cancel_scope.cancel()

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            if stream is not None:
                nursery.start_soon(own_output)
            nursery.start_soon(anyones_output)
    if stream is not None:
        stream.close()
    if not verdict:
        LOGGER.warning("health probe: no output from the engine within %.1f s", timeout)
    return bool(verdict) and verdict[0]
