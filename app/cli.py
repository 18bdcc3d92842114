"""`tributary serve`: open the engine, then serve HTTP until SIGINT or SIGTERM (the flags and
the configurations they make: `flags.py`).

Shutdown: the first SIGINT/SIGTERM starts a graceful shutdown (`/health` turns 503, the
listener closes, in-flight requests get `--graceful-timeout` seconds, then the engine aborts
what is left and frees the model). A second signal stops at once.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence
from functools import partial

import trio

from tributary import engine
from tributary.bench import cli as bench_cli
from tributary.engine import remote

from .flags import build_parser, configs, remote_config
from .heap import GEN0_THRESHOLD, settle_heap
from .loading import bound_port, serve_until_loaded
from .observe.exchange import JsonFormatter
from .server import open_http_server
from .settings import ServerSettings

__all__ = ["build_parser", "configure_logging", "main", "run_server"]

LOGGER = logging.getLogger("tributary.cli")


def _settle_heap(gc_threshold: int) -> None:
    if gc_threshold:
        frozen = settle_heap(gc_threshold)
        LOGGER.info("froze %d start-up objects; gc threshold %d", frozen, gc_threshold)


def configure_logging(settings: ServerSettings) -> None:
    """stderr at `settings.log_level`, as text or one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=settings.log_level.upper(), handlers=[handler], force=True)
    if settings.log_level != "debug":
        # httpx logs every request a front sends its workers (health probes included) at info.
        logging.getLogger("httpx").setLevel(logging.WARNING)


async def run_server(
    engine_config: engine.EngineConfig,
    settings: ServerSettings,
    fleet: remote.RemoteConfig | None = None,
    *,
    gc_threshold: int = GEN0_THRESHOLD,
) -> None:
    """Serve until the first SIGINT/SIGTERM (graceful), or a second one (immediate); from
    the workers of `fleet` when given, else from the model `engine_config` names. Once
    serving, `settle_heap(gc_threshold)` unless `gc_threshold` is 0."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def watch_signals() -> None:
                async for signum in signals:
                    if stop.is_set():
                        LOGGER.warning("second %s: stopping now", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return
                    LOGGER.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    stop.set()

            nursery.start_soon(watch_signals)
            if fleet is not None:
                async with remote.open_remote_engine(fleet) as front:
                    async with open_http_server(front, settings) as urls:
                        _settle_heap(gc_threshold)
                        print(
                            f"Tributary serving {front.model_info.name} from "
                            f"{len(fleet.workers)} worker(s), policy {fleet.policy}, at {urls[0]}",
                            flush=True,
                        )
                        await stop.wait()
                LOGGER.info("shut down")
                nursery.cancel_scope.cancel()
                return
            # The port answers 503 while the model loads, then the real server takes it over.
            LOGGER.info("loading %s", engine_config.model_path or engine.DEFAULT_MODEL)
            loaded, released = trio.Event(), trio.Event()
            loading_urls = await nursery.start(serve_until_loaded, settings, loaded, released)
            settings = dataclasses.replace(settings, port=bound_port(loading_urls[0]))
            async with engine.open_engine(engine_config) as eng:
                loaded.set()
                await released.wait()
                async with open_http_server(eng, settings) as urls:
                    _settle_heap(gc_threshold)
                    info = eng.model_info
                    print(
                        f"Tributary serving {eng.config.served_model_name or info.name} "
                        f"({info.path}, context length {info.context_length}, "
                        f"runner {engine_config.runner}) at {urls[0]}",
                        flush=True,
                    )
                    print(memory_line(eng), flush=True)
                    await stop.wait()
            LOGGER.info("shut down")
            nursery.cancel_scope.cancel()


def memory_line(eng: engine.Engine) -> str:
    """What the configuration allocates: the KV cache up front, the prefix cache's bound."""
    config, stats = eng.config, eng.stats()
    kv = f"{stats.kv_cache_bytes / (1 << 20):.0f} MiB" if stats.kv_cache_bytes else "n/a"
    prefix = (
        f"up to {config.prefix_cache_mb} MiB, {config.prefix_reuse} reuse"
        if config.prefix_cache_mb
        else "off"
    )
    return (
        f"KV cache: {kv} ({config.max_running_requests} slots x "
        f"{eng.model_info.context_length} tokens, {config.kv_cache_dtype}); "
        f"prefix cache: {prefix}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return bench_cli.run(args)
    try:
        engine_config, settings = configs(args)
        fleet = remote_config(args)
        if args.gc_threshold < 0:
            raise ValueError(f"--gc-threshold must be at least 0, got {args.gc_threshold}")
    except (ValueError, OSError) as exc:  # a flag value the engine cannot run with
        print(f"tributary: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings)
    failures: list[BaseException] = []
    try:
        trio.run(
            partial(run_server, gc_threshold=args.gc_threshold), engine_config, settings, fleet
        )
    except* (OSError, ValueError, engine.EngineError) as group:
        # A model that is not there, a context it cannot take, a port in use: say so plainly.
        failures.extend(group.exceptions)
    for failure in failures:
        print(f"tributary: error: {failure}", file=sys.stderr)
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
