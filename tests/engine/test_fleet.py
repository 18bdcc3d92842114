"""The fleet of upstream workers: the circuit breaker on the autojump clock, adding and
removing workers, each policy's choices, the cache-aware trees' bound, and health probes
against real loopback HTTP servers (on the real clock: under autojump, a probe's timeout
could fire while the kernel still carries the answer)."""

from __future__ import annotations

import collections
import contextlib
import functools
import random
import socket
import tracemalloc
from collections.abc import Callable

import httpx
import pytest
import trio

from tributary.engine.remote.breaker import Breaker
from tributary.engine.remote.fleet import Fleet
from tributary.engine.remote.health import (
    FAILURES_TO_UNHEALTHY,
    check_fleet_health,
    run_health_checks,
)
from tributary.engine.remote.policy import POLICIES, CacheAware
from tributary.engine.remote.radix_tree import RadixTree
from tributary.engine.remote.worker import Worker

URLS = ["http://w0:30000", "http://w1:30000", "http://w2:30000", "http://w3:30000"]
SYSTEM = "You are a careful assistant. Answer briefly and cite your sources. " * 4


def fleet_of(
    n: int,
    policy: str | CacheAware = "cache_aware",
    *,
    seed: int | None = None,
    breaker_factory: Callable[[], Breaker] = Breaker,
) -> Fleet:
    workers = [(url, "sglang") for url in URLS[:n]]
    return Fleet(workers, policy=policy, seed=seed, breaker_factory=breaker_factory)


def send(fleet: Fleet, key: str | list[int] | None) -> Worker:
    """Choose a worker for `key` and dispatch to it, as the RemoteEngine does."""
    worker = fleet.choose(key)
    assert worker is not None
    fleet.record_dispatch(worker, key)
    return worker


def distinct_prompts(n: int, length: int = 200, seed: int = 0) -> list[str]:
    """n random prompts over 26 letters: any two share a prefix of a letter or two at most."""
    rng = random.Random(seed)
    return ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=length)) for _ in range(n)]


def open_breaker(worker: Worker) -> None:
    for _ in range(worker.breaker.failure_threshold):
        worker.breaker.record_failure()
    assert worker.breaker.state == "open"


# -- the circuit breaker ---------------------------------------------------------------------


async def half_open(breaker: Breaker) -> Breaker:
    """`breaker`, opened by a run of failures and then left alone for `open_seconds`."""
    for _ in range(breaker.failure_threshold):
        breaker.record_failure()
    await trio.sleep(breaker.open_seconds)
    return breaker


async def test_breaker_opens_after_consecutive_failures_and_refuses_while_open(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = Breaker(failure_threshold=3, open_seconds=5.0)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()  # the run is broken: counting starts again
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    assert breaker.opened_total == 1
    await trio.sleep(4.9)
    assert breaker.state == "open"
    assert not breaker.allow() and not breaker.would_allow()


async def test_breaker_half_open_lets_one_trial_through_and_closes_on_success(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, open_seconds=5.0))
    assert breaker.state == "half_open"
    assert breaker.would_allow() and breaker.would_allow()  # asking takes nothing
    assert breaker.allow()
    assert not breaker.allow()  # the trial is out
    assert not breaker.would_allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(5))


async def test_breaker_reopens_when_the_trial_fails_and_waits_afresh(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=2, open_seconds=5.0))
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open" and breaker.opened_total == 2
    await trio.sleep(4.0)
    assert breaker.state == "open"  # the wait restarted at the failed trial
    await trio.sleep(1.0)
    assert breaker.state == "half_open"


async def test_breaker_success_threshold_needs_that_many_trials(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, success_threshold=2, open_seconds=1))
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "half_open"
    assert breaker.allow() and not breaker.allow()  # the second trial, still one at a time
    breaker.record_success()
    assert breaker.state == "closed"


async def test_breaker_a_trial_never_reported_is_lost_after_open_seconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    breaker = await half_open(Breaker(failure_threshold=1, open_seconds=5.0))
    assert breaker.allow()  # its request is cancelled: no outcome comes
    await trio.sleep(4.9)
    assert not breaker.allow()
    await trio.sleep(0.1)
    assert breaker.allow()


# -- adding, removing, choosing --------------------------------------------------------------


async def test_add_normalizes_and_refuses_duplicates_and_bad_urls() -> None:
    fleet = Fleet()
    worker = fleet.add("http://10.0.0.5:30000/", "openai")
    assert worker.url == "http://10.0.0.5:30000" and worker.kind == "openai"
    with pytest.raises(ValueError, match=r"http://10\.0\.0\.5:30000 is already in the fleet"):
        fleet.add("http://10.0.0.5:30000")
    for bad in ("10.0.0.5:30000", "ftp://10.0.0.5", "http://", "", "http://h:1/?x=1"):
        with pytest.raises(ValueError, match="worker URL") as caught:
            fleet.add(bad)
        assert repr(bad) in str(caught.value)
    # An OpenAI client's base URL: the front adds /v1/... itself.
    with pytest.raises(ValueError, match=r"http://h:8000/v1: give the server's own URL"):
        fleet.add("http://h:8000/v1/", "openai")
    assert fleet.workers == [worker]


@pytest.mark.parametrize("policy", POLICIES)
async def test_a_removed_worker_is_never_chosen(policy: str) -> None:
    fleet = fleet_of(3, policy, seed=1)
    removed = fleet.remove("http://w1:30000/")
    assert removed.removed and not removed.available()
    assert [w.url for w in fleet.workers] == ["http://w0:30000", "http://w2:30000"]
    chosen = {send(fleet, prompt) for prompt in distinct_prompts(60)}
    assert removed not in chosen and len(chosen) == 2
    with pytest.raises(KeyError, match="w1"):
        fleet.remove("http://w1:30000")
    again = fleet.add("http://w1:30000")
    assert again is not removed and not again.removed


@pytest.mark.parametrize("policy", POLICIES)
async def test_choose_is_none_without_an_available_worker(policy: str) -> None:
    assert Fleet(policy=policy).choose("hi") is None
    fleet = fleet_of(3, policy)
    w0, w1, w2 = fleet.workers
    assert fleet.choose("hi", exclude=[w0, w1, w2]) is None
    w0.healthy = False
    open_breaker(w1)
    assert fleet.choose("hi", exclude=[w2]) is None
    assert fleet.choose("hi") is w2


async def test_unknown_policy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="round_robin, power_of_two, cache_aware"):
        Fleet(policy="least_loaded")


async def test_a_half_open_worker_gets_one_trial_through_the_fleet(
    autojump_clock: trio.abc.Clock,
) -> None:
    fleet = fleet_of(2, "round_robin", breaker_factory=functools.partial(Breaker, open_seconds=2))
    w0, w1 = fleet.workers
    w0.healthy = False  # its probes failed, and so opened the breaker
    open_breaker(w0)
    await trio.sleep(2)
    assert w0.available()  # half-open: a request may be the trial, probe verdict or not
    picks = [fleet.choose(None) for _ in range(4)]
    assert picks.count(w0) == 1 and picks.count(w1) == 3
    w0.breaker.record_success()
    assert w0.breaker.state == "closed" and not w0.available()  # the last probe still failed
    w0.healthy = True
    assert w0.available()


# -- round_robin and power_of_two ------------------------------------------------------------


async def test_round_robin_cycles_and_skips_the_unavailable() -> None:
    fleet = fleet_of(3, "round_robin")
    w0, w1, w2 = fleet.workers
    assert [fleet.choose(None) for _ in range(6)] == [w0, w1, w2, w0, w1, w2]
    w1.healthy = False
    picks = [fleet.choose(None) for _ in range(6)]
    assert w1 not in picks and picks.count(w0) == picks.count(w2) == 3
    w1.healthy = True
    assert {fleet.choose(None) for _ in range(3)} == {w0, w1, w2}


def loaded_fleet(seed: int, loads: tuple[int, ...]) -> Fleet:
    fleet = fleet_of(len(loads), "power_of_two", seed=seed)
    for worker, load in zip(fleet.workers, loads, strict=True):
        worker.in_flight = load
    return fleet


async def test_power_of_two_takes_the_less_loaded_of_its_two_samples() -> None:
    fleet = loaded_fleet(7, (0, 5, 10))
    idle, busy, busiest = fleet.workers
    counts = collections.Counter(fleet.choose(None) for _ in range(3000))
    # Of the three pairs, two hold `idle` (it wins both) and one is (busy, busiest).
    assert busiest not in counts
    assert 1850 < counts[idle] < 2150 and 850 < counts[busy] < 1150


async def test_power_of_two_with_a_seed_repeats_its_choices() -> None:
    first, second = loaded_fleet(7, (3, 3, 3, 3)), loaded_fleet(7, (3, 3, 3, 3))
    picks = [first.choose(None) for _ in range(50)]
    assert len({w.url for w in picks if w}) == 4
    assert [w.url for w in picks if w] == [w.url for _ in range(50) if (w := second.choose(None))]


async def test_power_of_two_never_picks_an_unavailable_worker() -> None:
    fleet = loaded_fleet(3, (0, 100, 0, 50))
    w0, w1, w2, w3 = fleet.workers
    w0.healthy = False
    open_breaker(w2)
    assert {fleet.choose(None) for _ in range(200)} == {w3}  # the pair left is (w1, w3)
    w3.healthy = False
    assert {fleet.choose(None) for _ in range(20)} == {w1}


# -- cache_aware -----------------------------------------------------------------------------


async def test_cache_aware_keeps_a_shared_prefix_on_one_worker() -> None:
    fleet = fleet_of(4)
    for prompt in distinct_prompts(3, seed=1):
        send(fleet, prompt)  # the other workers hold something too
    first = send(fleet, SYSTEM + "What is Trio?")
    first.in_flight = 30  # busier, but within the balance thresholds (64 and 1.5x)
    for question in ("How do nurseries work?", "Explain cancel scopes.", "Why not asyncio?"):
        assert send(fleet, SYSTEM + question) is first


async def test_cache_aware_spreads_distinct_prompts() -> None:
    fleet = fleet_of(4)
    counts = collections.Counter(send(fleet, prompt) for prompt in distinct_prompts(40))
    # Each miss goes to the smallest tree; prompts of one length fill the four evenly.
    assert sorted(counts.values()) == [10, 10, 10, 10]


async def test_cache_aware_misses_go_to_the_smallest_tree_then_the_least_loaded() -> None:
    fleet = fleet_of(3)
    w0, w1, w2 = fleet.workers
    w0.in_flight, w1.in_flight, w2.in_flight = 5, 0, 3
    assert fleet.choose("nothing recorded yet") is w1  # all trees empty
    short, long = distinct_prompts(2, length=100)[0], distinct_prompts(1, length=900, seed=2)[0]
    fleet.record_dispatch(w1, long)
    fleet.record_dispatch(w2, short)
    assert fleet.choose(distinct_prompts(1, seed=3)[0]) is w0  # the smallest tree, though busiest


async def test_cache_aware_sends_to_the_least_loaded_when_load_is_imbalanced() -> None:
    fleet = fleet_of(3)
    w0, w1, w2 = fleet.workers
    assert send(fleet, SYSTEM + "one") is w0
    w0.in_flight, w1.in_flight, w2.in_flight = 100, 40, 20
    assert send(fleet, SYSTEM + "two") is w2  # 100 - 20 > 64 and 100 > 1.5 * 20
    w0.in_flight, w1.in_flight, w2.in_flight = 80, 20, 79  # 80 - 20 <= 64: balanced enough
    # The prefix wins over the load again; of its two holders, the less loaded.
    assert send(fleet, SYSTEM + "three") is w2


async def test_cache_aware_routes_token_ids_by_prefix() -> None:
    fleet = fleet_of(4)
    assert send(fleet, distinct_prompts(1)[0]) is fleet.workers[0]
    system = list(range(1000, 1300))
    owner = send(fleet, [*system, 7, 8, 9])
    for prompt in ([*system, 42], [*system, 1, 2, 3, 4], [*system, 150_000]):
        assert send(fleet, prompt) is owner
    # Text and ids are separate trees: text of the same code points is a miss, and goes to
    # the smallest text tree.
    text = "".join(map(chr, system))
    assert fleet.choose(text) is not owner
    assert send(fleet, list(range(5000, 5300))) is not owner
    # Ids no tokenizer has (the worker will refuse them) are still routed, not an error here.
    odd = [-1, 0xD800, 0x110000, 2**40]
    assert send(fleet, odd) is send(fleet, [*odd, 5])


async def test_cache_aware_trees_stay_bounded_over_10k_random_prompts() -> None:
    policy = CacheAware(max_tree_size=20_000)
    fleet = fleet_of(2, policy)
    rng = random.Random(5)
    systems = distinct_prompts(20, length=300, seed=9)
    tracemalloc.start()
    try:
        for _ in range(10_000):
            prefix = rng.choice(systems)[: rng.randrange(0, 300)]
            send(fleet, prefix + "".join(rng.choices("abcdefgh", k=rng.randrange(1, 400))))
            assert all(policy.tree_size(w) <= 20_000 for w in fleet.workers)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Unbounded, the prompts' text alone would be about 3.5 MB; bounded, two trees of 20k
    # characters with their nodes take about 0.5 MB.
    assert peak < 1_000_000, (held, peak)
    last = SYSTEM + "the most recent prompt"
    owner = send(fleet, last)
    assert send(fleet, last) is owner  # the most recent survives eviction


def test_radix_tree_evicts_least_recently_inserted_leaves() -> None:
    tree = RadixTree(max_size=100)
    tree.insert("a" * 40)
    tree.insert("b" * 40)
    tree.insert("a" * 40)  # "a..." is now the more recent
    tree.insert("c" * 40)  # 120 > 100: "b..." leaves
    assert (tree.match("a" * 40), tree.match("b" * 40), tree.match("c" * 40)) == (40, 0, 40)
    assert tree.size == 80
    tree.insert("a" * 20 + "x" * 30)  # splits "a...": the shared 20 are counted once
    # 110 > 100 again: the least recent leaf is the lower half of the split "a...".
    assert tree.size == 90 and tree.match("a" * 20 + "x" * 10) == 30
    assert (tree.match("a" * 40), tree.match("c" * 40)) == (20, 40)


def test_radix_tree_memory_stays_flat_when_one_prompt_repeats() -> None:
    tree = RadixTree(max_size=1000)
    tree.insert(SYSTEM)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20_000):
            tree.insert(SYSTEM)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000  # bytes: not one heap entry kept per insert


# -- health checks, against real loopback servers on the real clock ------------------------


class HealthServer:
    """A loopback HTTP/1.1 server whose /health answers `status`, or never answers while
    `status` is None. Counts the probes it got."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.probes = 0
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> HealthServer:
        serve = functools.partial(trio.serve_tcp, self._answer, 0, host="127.0.0.1")
        listeners = await nursery.start(serve)
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        return self

    async def _answer(self, stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
            assert head.startswith(b"GET /health HTTP/1.1\r\n"), head
            self.probes += 1
            if self.status is None:
                await trio.sleep_forever()
            reply = f"HTTP/1.1 {self.status} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            with contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(reply.encode())


def refused_url() -> str:
    """A loopback URL where nothing listens: the port was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_one_round_judges_each_worker_within_the_timeout(nursery: trio.Nursery) -> None:
    servers = [await HealthServer(status).start(nursery) for status in (200, 503, None)]
    fleet = Fleet([(server.url, "sglang") for server in servers])
    fleet.add(refused_url())
    up, down, hung, refused = fleet.workers
    async with httpx.AsyncClient() as client:
        started = trio.current_time()
        await check_fleet_health(fleet, client, timeout=0.5)
        assert trio.current_time() - started < 1.5  # concurrent: one timeout, not the sum
        # One failed probe is not a verdict (a busy machine can miss one)...
        assert all(w.healthy for w in fleet.workers)
        for _ in range(FAILURES_TO_UNHEALTHY - 1):
            await check_fleet_health(fleet, client, timeout=0.5)
        # ... three in a row are.
        assert [w.healthy for w in fleet.workers] == [True, False, False, False]
        assert [s.probes for s in servers] == [FAILURES_TO_UNHEALTHY] * 3
        assert {fleet.choose(None) for _ in range(10)} == {up}
    assert up.breaker.state == "closed"
    assert [w.breaker.state for w in (down, hung, refused)] == ["open"] * 3


async def test_a_worker_that_comes_back_rejoins_through_a_probe(nursery: trio.Nursery) -> None:
    server = await HealthServer(503).start(nursery)
    fleet = Fleet([(server.url, "sglang")], breaker_factory=lambda: Breaker(open_seconds=1.0))
    (worker,) = fleet.workers
    async with httpx.AsyncClient() as client:
        for _ in range(worker.breaker.failure_threshold):
            await check_fleet_health(fleet, client, timeout=1)
        assert worker.breaker.state == "open" and fleet.choose(None) is None
        server.status = 200
        await check_fleet_health(fleet, client, timeout=1)
        assert not worker.healthy  # one pass is not a verdict
        await check_fleet_health(fleet, client, timeout=1)
        # Healthy again, but the breaker still waits: no request goes there yet.
        assert worker.healthy and worker.breaker.state == "open"
        assert fleet.choose(None) is None
        await trio.sleep(1.0)
        assert worker.breaker.state == "half_open"
        await check_fleet_health(fleet, client, timeout=1)  # the probe is the trial
    assert worker.breaker.state == "closed"
    assert fleet.choose(None) is worker
    assert worker.breaker.opened_total == 1


async def test_a_passing_probe_ends_a_run_of_failures(nursery: trio.Nursery) -> None:
    server = await HealthServer(503).start(nursery)
    fleet = Fleet([(server.url, "sglang")])
    (worker,) = fleet.workers
    async with httpx.AsyncClient() as client:
        for status in (503, 503, 200, 503, 503):  # never three failures in a row
            server.status = status
            await check_fleet_health(fleet, client, timeout=1)
        assert worker.breaker.state == "closed" and worker.healthy
        await check_fleet_health(fleet, client, timeout=1)
    assert worker.breaker.state == "open" and not worker.healthy


async def test_health_checks_follow_the_fleet_as_it_changes(nursery: trio.Nursery) -> None:
    first, hung, later = [await HealthServer(s).start(nursery) for s in (200, None, 200)]
    fleet = Fleet([(first.url, "sglang"), (hung.url, "sglang")])
    async with httpx.AsyncClient() as client:
        checks = functools.partial(run_health_checks, interval=0.05, timeout=0.5)
        await nursery.start(checks, fleet, client)
        # Started after the first round: every worker has been probed.
        assert (first.probes, hung.probes) == (1, 1)
        fleet.add(later.url)
        fleet.remove(first.url)
        probed_at_removal = first.probes
        with trio.fail_after(5):
            while later.probes < 3:  # the hung worker's timeouts do not stop the rounds
                await trio.sleep(0.05)
        # Three rounds later: at most the one round that may have begun before the removal
        # (the first round outlasted the interval, so the next one starts at once).
        assert first.probes <= probed_at_removal + 1
        assert hung.probes >= 3 and [w.healthy for w in fleet.workers] == [False, True]
        nursery.cancel_scope.cancel()  # stop the checks before their client closes
