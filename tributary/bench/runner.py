"""`run_benchmark`: build the prompts, warm up, then send the workload at a fixed concurrency
or a Poisson rate (arrivals.py), and summarize what came back (report.py).

One httpx.AsyncClient carries every request; its pool holds as many connections as requests
may be in flight, so no request waits for a connection inside httpx.

Synopsis::

    result = await run_benchmark(BenchConfig(base_url=url, num_prompts=64, concurrency=8))
    result["output_throughput"], result["p99_ttft_ms"]
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import time

import httpx

from .arrivals import fixed_concurrency, poisson_arrivals
from .backends import Backend, send_request
from .config import BenchConfig
from .progress import open_progress
from .report import Result, summarize
from .streams import RequestRecord
from .workload import (
    Prompt,
    ServerTokenizer,
    Workload,
    WorkloadError,
    WorkloadSpec,
    build_workload,
    load_workload,
    save_workload,
)

__all__ = ["BenchConfig", "run_benchmark"]

DEFAULT_ENDPOINTS = {"generate": "/generate", "openai": "/v1/completions"}

#: Seconds an idle connection is kept for reuse. Servers close idle connections after their own
#: keep-alive timeout (5 s in Hypercorn, uvicorn and llama-server); a request sent on one just
#: as the server closes it fails with a reset (httpx's default expiry is those same 5 s, and 2
#: of 3 runs of 1,000 requests lost one request that way). Expiring first avoids the race.
KEEPALIVE_EXPIRY = 1.0


async def run_benchmark(config: BenchConfig, *, workload: Workload | None = None) -> Result:
    """Run one benchmark and return its result (the document `--output-json` writes).

    Raises WorkloadError when the prompts cannot be built, httpx.HTTPError when the model
    cannot be looked up; every failure of a benchmark request is counted in the result."""
    limit = config.concurrency
    pool = httpx.Limits(
        max_connections=limit, max_keepalive_connections=limit, keepalive_expiry=KEEPALIVE_EXPIRY
    )
    timeout = httpx.Timeout(None, connect=30.0)
    # trust_env=False: a proxy from the environment must not sit between client and server.
    async with httpx.AsyncClient(limits=pool, timeout=timeout, trust_env=False) as client:
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        if workload is None:
            workload = await prepare_workload(client, config, headers)
        backend = Backend(
            kind=config.backend,
            base_url=config.base_url,
            endpoint=config.endpoint or DEFAULT_ENDPOINTS[config.backend],
            output_len=config.output_len,
            model=config.model,
            ignore_eos=config.ignore_eos,
            temperature=config.temperature,
            extra_body=config.extra_body,
            api_key=config.api_key,
        )
        if backend.kind == "openai" and backend.model is None:
            backend = dataclasses.replace(backend, model=await first_model(client, backend))

        warmup = await run_requests(
            client, backend, workload.warmup_prompts, config, description="warm-up"
        )
        started_at = datetime.datetime.now(datetime.UTC)
        cpu_start, start = time.process_time(), time.perf_counter()
        records = await run_requests(
            client, backend, workload.prompts, config, description="requests"
        )
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
    return summarize(
        config,
        backend,
        workload,
        records,
        duration=duration,
        started_at=started_at,
        warmup_records=warmup,
        run_start=start,
        client_cpu=client_cpu,
    )


async def prepare_workload(
    client: httpx.AsyncClient, config: BenchConfig, headers: dict[str, str]
) -> Workload:
    if config.load_prompts:
        workload = load_workload(config.load_prompts)
        if len(workload.prompts) < config.num_prompts:
            raise WorkloadError(
                f"{config.load_prompts} holds {len(workload.prompts)} prompts, "
                f"fewer than the {config.num_prompts} asked for"
            )
        if len(workload.warmup_prompts) < config.warmup:
            raise WorkloadError(
                f"{config.load_prompts} holds {len(workload.warmup_prompts)} warm-up prompts, "
                f"fewer than the {config.warmup} asked for"
            )
        return dataclasses.replace(
            workload,
            prompts=workload.prompts[: config.num_prompts],
            warmup_prompts=workload.warmup_prompts[: config.warmup],
        )
    spec = WorkloadSpec(
        num_prompts=config.num_prompts,
        input_len=config.input_len,
        shared_prefix_len=config.shared_prefix_len,
        seed=config.seed,
        warmup=config.warmup,
    )
    tokenizer = ServerTokenizer(client, config.tokenizer_from or config.base_url, headers=headers)
    workload = await build_workload(tokenizer, spec)
    if config.save_prompts:
        save_workload(workload, config.save_prompts)
    return workload


async def first_model(client: httpx.AsyncClient, backend: Backend) -> str:
    """The first model of the server's /v1/models (Tributary answers 404 to any other)."""
    url = backend.base_url.rstrip("/") + "/v1/models"
    response = await client.get(url, headers=backend.headers)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise WorkloadError(f"{url} lists no model; pass --model")
    return str(models[0]["id"])


async def run_requests(
    client: httpx.AsyncClient,
    backend: Backend,
    prompts: list[Prompt],
    config: BenchConfig,
    *,
    description: str,
) -> list[RequestRecord]:
    """One record per prompt, in prompt order, whatever the order of completion."""
    records = [RequestRecord(index=i, prompt_tokens=p.tokens) for i, p in enumerate(prompts)]
    if not prompts:
        return records
    async with open_progress(len(prompts), description=description, enabled=config.progress) as bar:

        async def one(i: int) -> None:
            await send_request(client, backend, prompts[i], records[i], timeout=config.timeout)
            bar.advance(ok=records[i].ok)

        if math.isinf(config.request_rate) and config.concurrency is not None:
            await fixed_concurrency(len(prompts), config.concurrency, one)
        else:
            await poisson_arrivals(
                len(prompts), config.request_rate, config.concurrency, config.seed, one
            )
    return records
