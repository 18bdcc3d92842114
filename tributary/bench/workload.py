"""Prompts of a fixed token length, made of the served model's own tokens with a fixed seed.

No data set is downloaded: a short built-in text is tokenized by the server under test (or by
the one `--tokenizer-from` names), its distinct token ids are the pool, and each prompt is a
seeded draw from that pool, detokenized, then trimmed or extended until the server counts
exactly the asked number of tokens (re-tokenizing text rarely gives back the ids it came from).

Synopsis::

    tokenizer = ServerTokenizer(client, "http://127.0.0.1:30000")
    workload = await build_workload(tokenizer, WorkloadSpec(num_prompts=100, input_len=128))
    workload.prompts[0].text, workload.prompts[0].tokens
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any, TypeGuard

import httpx
import trio

__all__ = [
    "Prompt",
    "ServerTokenizer",
    "Workload",
    "WorkloadError",
    "WorkloadSpec",
    "build_workload",
    "load_workload",
    "save_workload",
]

#: The pool's source: plain English with digits and punctuation, so the pool holds ordinary
#: text tokens (no control tokens, no lone bytes that would detokenize to U+FFFD).
SEED_TEXT = (
    "A river gathers its tributaries over hundreds of miles: small creeks in the hills, "
    "streams that drain farmland, melted snow from mountains 4,000 metres high. Engineers "
    "measure the flow at gauging stations every 15 minutes and publish daily averages; a "
    "wet spring can double the volume, while a dry summer leaves sandbars exposed. Boats "
    "carry grain, timber, coal and containers downstream to the harbour, where cranes load "
    "ships bound for distant ports. Fishermen know which pools hold trout, and birds follow "
    "the water north each year. Bridges, locks, dams and mills were built along its banks; "
    "some still work today, others are museums where children learn how water turned wheels "
    "that ground flour, sawed logs or spun cotton. Why does the current slow at the bend? "
    "Because the channel widens, the bed deepens, and friction with the banks grows."
)

#: Detokenize/re-tokenize rounds before settling for the closest length found.
MAX_ROUNDS = 8

#: Prompts built at once (each build is a few /tokenize and /detokenize calls).
BUILD_PARALLELISM = 8


class WorkloadError(Exception):
    """The prompts cannot be built: no tokenizer endpoint, or an answer of the wrong shape."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    #: Its length as the building server's tokenizer counts it (no special tokens added).
    tokens: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    num_prompts: int = 100
    #: Tokens per prompt, the shared prefix included.
    input_len: int = 128
    #: Tokens at the start of every prompt that are the same for all of them (0: none).
    shared_prefix_len: int = 0
    seed: int = 1
    #: Extra prompts, distinct from the measured ones, for warm-up requests.
    warmup: int = 1

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.warmup < 0:
            raise ValueError("num_prompts and input_len must be at least 1, warmup at least 0")
        if not 0 <= self.shared_prefix_len < self.input_len:
            raise ValueError(
                f"shared_prefix_len must be in [0, input_len), got {self.shared_prefix_len}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    spec: WorkloadSpec
    #: The measured prompts, in the order they are sent.
    prompts: list[Prompt]
    #: `spec.warmup` prompts for the warm-up requests (never measured).
    warmup_prompts: list[Prompt]
    #: The server whose tokenizer built it.
    tokenizer_url: str


class ServerTokenizer:
    """The served model's tokenizer, through a server's `/tokenize` and `/detokenize`.

    Speaks both wire shapes in use: SGLang's, Tributary's and vLLM's (`{"prompt": text}` in,
    `{"tokens": [...]}` out; `{"tokens": [...]}` in, `{"text"}` or vLLM's `{"prompt"}` out)
    and llama.cpp's server's (`{"content": text}` in, `{"content"}` out of `/detokenize`).
    The first `tokenize` finds out which; llama-server answers the other shape with an empty
    token list, Tributary with a 400, so either way the second shape is tried.
    """

    def __init__(
        self, client: httpx.AsyncClient, base_url: str, *, headers: dict[str, str] | None = None
    ) -> None:
        self.client = client
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}
        self._shape: str | None = None  # "prompt" or "content" once known

    async def tokenize(self, text: str) -> list[int]:
        shapes = [self._shape] if self._shape else ["prompt", "content"]
        answers = []
        for shape in shapes:
            body: dict[str, Any] = (
                {"prompt": text, "add_special_tokens": False}
                if shape == "prompt"
                else {"content": text, "add_special": False}
            )
            response = await self._post("/tokenize", body)
            tokens = _json(response).get("tokens") if response.status_code == 200 else None
            if _is_token_list(tokens) and (tokens or not text):
                self._shape = shape
                return list(tokens)
            answers.append(f"{response.status_code} {response.text[:200]}")
        raise WorkloadError(f"{self.base_url}/tokenize gave no token ids: {'; '.join(answers)}")

    async def detokenize(self, tokens: list[int]) -> str:
        response = await self._post("/detokenize", {"tokens": tokens})
        answer = _json(response) if response.status_code == 200 else {}
        for key in ("text", "content", "prompt"):
            if isinstance(answer.get(key), str):
                return str(answer[key])
        raise WorkloadError(
            f"{self.base_url}/detokenize answered {response.status_code}: {response.text[:200]}"
        )

    async def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            response = await self.client.post(self.base_url + path, json=body, headers=self.headers)
        except httpx.HTTPError as exc:
            raise WorkloadError(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code in (404, 405):
            raise WorkloadError(
                f"{self.base_url} has no {path}; build the prompts against a server that has "
                "one (--tokenizer-from URL) or load saved ones (--load-prompts PATH)"
            )
        return response


async def build_workload(tokenizer: ServerTokenizer, spec: WorkloadSpec) -> Workload:
    """The same spec and the same tokenizer always give the same prompts. Prompt i depends
    only on (seed, i), so the warm-up count never changes the measured prompts."""
    pool = sorted(set(await tokenizer.tokenize(SEED_TEXT)))
    if not pool:
        raise WorkloadError(f"{tokenizer.base_url}/tokenize gave no tokens for the seed text")
    lead = ""
    if spec.shared_prefix_len:
        rng = random.Random(f"{spec.seed}:prefix")
        lead = (await _prompt_of_length(tokenizer, rng, pool, spec.shared_prefix_len, "")).text
    total = spec.num_prompts + spec.warmup
    built: list[Prompt | None] = [None] * total
    limiter = trio.CapacityLimiter(BUILD_PARALLELISM)

    async def build(i: int) -> None:
        async with limiter:
            rng = random.Random(f"{spec.seed}:{i}")
            built[i] = await _prompt_of_length(tokenizer, rng, pool, spec.input_len, lead)

    async with trio.open_nursery() as nursery:
        for i in range(total):
            nursery.start_soon(build, i)
    prompts = [p for p in built if p is not None]
    return Workload(
        spec=spec,
        prompts=prompts[: spec.num_prompts],
        warmup_prompts=prompts[spec.num_prompts :],
        tokenizer_url=tokenizer.base_url,
    )


async def _prompt_of_length(
    tokenizer: ServerTokenizer, rng: random.Random, pool: list[int], target: int, lead: str
) -> Prompt:
    """`lead` followed by seeded pool tokens, `target` tokens in all as the server counts
    them, or the closest length found in MAX_ROUNDS."""
    lead_tokens = len(await tokenizer.tokenize(lead)) if lead else 0
    ids = [rng.choice(pool) for _ in range(max(target - lead_tokens, 1))]
    best: Prompt | None = None
    for _ in range(MAX_ROUNDS):
        text = lead + await tokenizer.detokenize(ids)
        count = len(await tokenizer.tokenize(text))
        if best is None or abs(count - target) < abs(best.tokens - target):
            best = Prompt(text, count)
        if count == target:
            break
        if count > target:
            ids = ids[: max(len(ids) - (count - target), 1)]
        else:
            ids += [rng.choice(pool) for _ in range(target - count)]
    assert best is not None
    return best


def save_workload(workload: Workload, path: str | Path) -> None:
    document = {
        "spec": dataclasses.asdict(workload.spec),
        "tokenizer_url": workload.tokenizer_url,
        "prompts": [dataclasses.asdict(p) for p in workload.prompts],
        "warmup_prompts": [dataclasses.asdict(p) for p in workload.warmup_prompts],
    }
    Path(path).write_text(json.dumps(document, ensure_ascii=False, indent=1))


def load_workload(path: str | Path) -> Workload:
    """A workload `save_workload` wrote: the same prompt texts for every server of a run."""
    document = json.loads(Path(path).read_text())
    return Workload(
        spec=WorkloadSpec(**document["spec"]),
        prompts=[Prompt(**p) for p in document["prompts"]],
        warmup_prompts=[Prompt(**p) for p in document["warmup_prompts"]],
        tokenizer_url=document["tokenizer_url"],
    )


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        answer = response.json()
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _is_token_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
