"""An engine's cache events to the router (cluster/engine_host/router_events.py) over the router
actor's own feed, the actor's class run in process, and to a router that joins late. Oracle: a
PrefixIndex fed the same events directly, in order."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from hybridserve.cluster.engine_host.host import EngineHost
from hybridserve.cluster.engine_host.router_events import RouterEvents
from hybridserve.cluster.messages import GenerateRequest
from hybridserve.cluster.orchestrator import EngineDied, FeedLost
from hybridserve.cluster.routing.prefix_index import PrefixIndex, ReuseScore, prompt_chain
from hybridserve.cluster.transport.token_feed import EngineFeed
from hybridserve.workers import Engine, EngineConfig, SamplingParams
from hybridserve.workers.cache.events import BlockRemoved, BlockStored, event_to_dict
from tests.cluster.control.test_actors import router_actor, router_endpoint

ENGINE = "decode-0"
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + start) % 250 + 1 for i in range(70)] for start in (0, 3)]


class Forwarded:
    """An engine's event sink: each batch to `send` (as the EngineHost's flush does) and to
    the oracle index."""

    def __init__(self, send: Any, oracle: PrefixIndex) -> None:
        self.send, self.oracle = send, oracle

    def on_cache_events(self, events: list[Any]) -> None:
        batch = [event_to_dict(event) for event in events]
        self.send(ENGINE, batch)
        self.oracle.apply(ENGINE, batch)


def oracle_index() -> PrefixIndex:
    index = PrefixIndex(16, partial_reuse=False)
    index.add_engine(ENGINE)
    return index


def run(engine: Engine, prompt: list[int]) -> None:
    engine.add_request(prompt, PARAMS)
    while engine.has_unfinished_requests():
        engine.step()


def scores(index: PrefixIndex) -> list[dict[str, Any]]:
    """What the index says the engine would reuse of each prompt."""
    zero = ReuseScore(ENGINE, 0, 0)
    return [
        vars(index.scores(prompt_chain(prompt, None, 16)).get(ENGINE, zero)) for prompt in PROMPTS
    ]


def test_an_engine_s_events_reach_the_index_in_order_and_applied_waits_for_them():
    """Batches from the stepping thread (here a thread of asyncio's), a clear's removals
    last: once `applied()` returns, the router's index is the oracle's."""
    engine = Engine(EngineConfig(model="tiny", block_size=16, enable_partial_reuse=False))
    oracle = oracle_index()

    async def scenario() -> list[tuple[list[Any], list[Any]]]:
        actor = router_actor()
        events = RouterEvents(
            ENGINE,
            0,
            lambda: EngineFeed("router", router_endpoint(actor)),
            asyncio.get_running_loop(),
        )
        engine.subscribe(Forwarded(events.send, oracle))
        for prompt in PROMPTS:
            await asyncio.to_thread(run, engine, prompt)
        await asyncio.wait_for(events.applied(), 10)
        served = (scores(actor.index), scores(oracle))
        await asyncio.to_thread(engine.clear_cache)
        await asyncio.wait_for(events.applied(), 10)
        cleared = (scores(actor.index), scores(oracle))
        assert events.num_applied == events.num_batches > 2
        events.close()
        actor.feeds.close()
        return [served, cleared]

    served, cleared = asyncio.run(scenario())
    assert served[0] == served[1] and any(score["attention_tokens"] for score in served[0])
    assert cleared[0] == cleared[1]  # the clear's removals applied, after all the rest
    assert not any(score["attention_tokens"] or score["snapshot_tokens"] for score in cleared[0])


STORED = [event_to_dict(BlockStored(b"x" * 16, b"", 16))]
REMOVED = [event_to_dict(BlockRemoved(b"x" * 16))]


class Breaks:
    """A connection to the router that breaks (the router lives) on the first call through
    it, after the call went out (`lands`) or before."""

    def __init__(self, feed: EngineFeed, lands: bool) -> None:
        self.feed, self.lands = feed, lands
        self.calls: list[int] = []  # the seq of each call

    async def connect(self) -> None:
        await self.feed.connect()

    async def call(self, method: str, *args: Any) -> Any:
        self.calls.append(args[2])
        if self.lands:
            await self.feed.call(method, *args)
        raise FeedLost("the token feed from engine router was lost: reset")


def test_a_batch_is_resent_on_a_new_connection_under_its_number_until_answered():
    """Its first connection breaks before the call goes out, the second after it landed (its
    answer lost): the third carries it again, and the router drops that copy."""

    async def scenario() -> tuple[list[Breaks], int, int, int]:
        actor = router_actor()
        broken = [
            Breaks(EngineFeed("router", router_endpoint(actor)), lands) for lands in (False, True)
        ]
        feeds: list[Any] = list(broken)

        def new_feed() -> Any:
            return feeds.pop(0) if feeds else EngineFeed("router", router_endpoint(actor))

        events = RouterEvents(ENGINE, 0, new_feed, asyncio.get_running_loop())
        events.send(ENGINE, STORED)
        await asyncio.wait_for(events.applied(), 10)
        held = actor.index.stats().num_blocks
        events.send(ENGINE, REMOVED)
        await asyncio.wait_for(events.applied(), 10)
        events.close()
        actor.feeds.close()
        return broken, held, actor.index.stats().num_blocks, actor._next_seq[ENGINE]

    broken, held, left, next_seq = asyncio.run(scenario())
    assert [b.calls for b in broken] == [[0], [0]]
    assert (held, left, next_seq) == (1, 0, 2)  # two calls applied, the copy dropped


class Gone:
    """The router's connection once the router is gone."""

    reading = None  # no connection to close

    async def connect(self) -> None:
        raise EngineDied("router")

    async def call(self, method: str, *args: Any) -> Any:
        raise EngineDied("router")


def test_once_the_router_is_gone_applied_raises_and_later_batches_are_dropped():
    async def scenario() -> RouterEvents:
        events = RouterEvents(ENGINE, 0, Gone, asyncio.get_running_loop())
        events.send(ENGINE, STORED)
        with pytest.raises(RuntimeError, match="cache events stopped: engine router died"):
            await asyncio.wait_for(events.applied(), 10)
        events.send(ENGINE, REMOVED)
        await asyncio.sleep(0.01)
        events.close()
        return events

    events = asyncio.run(scenario())
    assert events.stopped is not None and events._events == []


def test_the_router_drops_batches_applied_already_and_those_of_an_older_incarnation():
    """A copy of a batch can reach the router after a later batch: the first copy was still
    unread on a connection that broke, and the resent one was answered first. Applied
    twice, it would bring back a removed block."""
    actor = router_actor()
    actor.apply_events(ENGINE, 0, 0, STORED)
    actor.apply_events(ENGINE, 0, 1, REMOVED)
    actor.apply_events(ENGINE, 0, 0, STORED)  # the late copy
    assert actor.index.stats().num_blocks == 0
    actor.apply_events(ENGINE, -1, 2, STORED)  # an incarnation that died
    assert actor.index.stats().num_blocks == 0
    actor.apply_events(ENGINE, 0, 2, STORED)
    assert actor.index.stats().num_blocks == 1
    actor.feeds.close()


class Stream:
    """A late router's index, checking that no block reaches it twice without a removal."""

    def __init__(self) -> None:
        self.index = PrefixIndex(16)
        self.index.add_engine(ENGINE)
        self.held: set[bytes] = set()

    def __call__(self, engine: str, batch: list[dict[str, Any]]) -> None:
        for event in batch:
            if event["kind"] == "block_stored":
                assert event["block_hash"] not in self.held, "a block sent twice"
                self.held.add(event["block_hash"])
            elif event["kind"] == "block_removed":
                self.held.discard(event["block_hash"])
        self.index.apply(engine, batch)


def test_a_router_that_joins_late_gets_the_cache_first_then_what_follows():
    """Routers started in place of a dead one: the host sends each what the cache holds (one
    batch), then every batch after it, none twice, even while requests run. Oracle: an index
    fed every batch from the start; each late one must equal it, and score every prompt
    alike."""
    host = EngineHost(
        ENGINE, EngineConfig(model="tiny", block_size=16, snapshot_interval=32, max_num_seqs=4)
    )
    early = Stream()
    late: list[Stream] = []
    prompts = [[(5 * i + start) % 250 + 1 for i in range(40 + 9 * start)] for start in range(8)]
    prompts += [[*prompt, 7, 8, 9] for prompt in prompts]

    async def one(prompt: list[int]) -> None:
        request = GenerateRequest(f"r{len(prompt)}-{prompt[0]}", prompt, {"max_tokens": 5})
        async for _ in host.generate(request):
            pass

    async def run(batch: list[list[int]]) -> None:
        await asyncio.gather(*(one(p) for p in batch))

    async def scenario() -> None:
        host.cache_events.add_sink("early", early, host.engine)
        await run(prompts[:4])
        running = asyncio.ensure_future(run(prompts[4:12]))
        while not running.done():  # routers joining while the requests run
            late.append(Stream())
            await asyncio.to_thread(
                host.cache_events.add_sink, f"late-{len(late)}", late[-1], host.engine
            )
            await asyncio.sleep(0.002)
        await run(prompts[12:])

    try:
        asyncio.run(scenario())
        host.engine.publish_cache_events()
        host.cache_events.flush()
        held = sum(1 for _ in host.engine.cache.tree.nodes())
        assert early.index.stats().num_blocks == held > 0 and len(late) > 1
        for stream in late:
            assert stream.index.stats() == early.index.stats()
            for prompt in prompts:
                chain = prompt_chain([*prompt, 1], None, 16)
                assert stream.index.scores(chain) == early.index.scores(chain)
    finally:
        host.shutdown()
