import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.prefix_index import ApproximateIndex, BlockHolders, PreciseIndex, leading_matches
from dispatcher.view import WorkerView
from gpu_workers.kv_publisher import KvMirror
from gpu_workers.prefix_cache import PrefixCache
from queue_schemas.messages import Heartbeat, KvEvent, KvEventKind, KvSnapshot, WorkerState
from queue_schemas.names import Names


def event(seq: int, kind: KvEventKind, *hashes: str) -> KvEvent:
    return KvEvent(worker_id="w", seq=seq, kind=kind, block_hashes=hashes)


def test_leading_matches_stop_at_the_first_miss() -> None:
    assert leading_matches({"a", "b", "d"}, ["a", "b", "c", "d"]) == 2


def test_precise_index_applies_events_in_order() -> None:
    index = PreciseIndex()
    assert index.apply(event(1, KvEventKind.CLEARED))
    assert index.apply(event(2, KvEventKind.STORED, "a", "b"))
    assert index.apply(event(3, KvEventKind.REMOVED, "b"))
    assert index.matched(["a", "b"]) == 1
    assert index.apply(event(3, KvEventKind.STORED, "zzz")), "an event seen before is ignored"
    assert index.blocks == {"a"}


def test_a_gap_is_detected_and_a_snapshot_resyncs() -> None:
    index = PreciseIndex()
    index.apply(event(1, KvEventKind.CLEARED))
    assert not index.apply(event(3, KvEventKind.STORED, "c"))
    assert not index.in_sync
    assert index.matched(["a"]) == 0, "an index out of sync matches nothing"
    index.load(KvSnapshot(worker_id="w", seq=3, block_hashes=("a", "c"), taken_at=0))
    assert index.apply(event(3, KvEventKind.STORED, "c"))
    assert index.apply(event(4, KvEventKind.STORED, "d"))
    assert index.matched(["a"]) == 1
    assert index.blocks == {"a", "c", "d"}


def test_a_clear_ends_a_gap() -> None:
    index = PreciseIndex()
    assert not index.apply(event(5, KvEventKind.STORED, "x"))
    assert index.apply(event(6, KvEventKind.CLEARED))
    assert index.in_sync


def test_approximate_index_is_lru_bounded() -> None:
    index = ApproximateIndex(capacity_blocks=3)
    index.record(["a", "b"])
    index.record(["c", "d"])
    assert index.matched(["a"]) == 0
    assert index.matched(["b", "c", "d"]) == 3


def test_prefix_cache_reports_stores_and_lru_evictions() -> None:
    cache = PrefixCache(3)
    assert cache.insert(["a", "b"]) == (["a", "b"], [])
    assert cache.match(["a", "b", "c"]) == 2
    assert cache.insert(["x", "y"]) == (["x", "y"], ["b"]), "the tail of the older prefix goes first"
    assert cache.hashes() == ["a", "y", "x"]


def test_mirror_rebuilds_what_consumers_rebuild() -> None:
    mirror = KvMirror()
    index = PreciseIndex()
    changes = [
        (KvEventKind.CLEARED, ()),
        (KvEventKind.STORED, ("a", "b")),
        (KvEventKind.REMOVED, ("a",)),
        (KvEventKind.STORED, ("c",)),
    ]
    for kind, hashes in changes:
        seq = mirror.apply(kind, hashes)
        assert index.apply(KvEvent(worker_id="w", seq=seq, kind=kind, block_hashes=hashes))
    assert index.blocks == mirror.blocks == {"b", "c"}


def test_block_holders_agree_with_per_worker_matching() -> None:
    import random

    rng = random.Random(3)
    chain = [f"b{i}" for i in range(12)]
    holders = BlockHolders()
    indexes = {}
    for w in range(20):
        held = {h for h in chain if rng.random() < 0.8}
        holders.add(f"w{w}", held)
        indexes[f"w{w}"] = held
    for cut in range(len(chain) + 1):
        prompt = chain[:cut]
        expected = {w: leading_matches(held, prompt) for w, held in indexes.items()}
        got = holders.matched(prompt)
        assert {w: got.get(w, 0) for w in indexes} == expected


def test_precise_index_keeps_block_holders_in_step() -> None:
    holders = BlockHolders()
    index = PreciseIndex("w", holders)
    index.apply(event(1, KvEventKind.CLEARED))
    index.apply(event(2, KvEventKind.STORED, "a", "b"))
    assert holders.matched(["a", "b"]) == {"w": 2}
    index.apply(event(3, KvEventKind.REMOVED, "b"))
    assert holders.matched(["a", "b"]) == {"w": 1}
    assert not index.apply(event(9, KvEventKind.STORED, "c"))
    assert holders.matched(["a"]) == {}, "an index out of sync must not attract placements"
    index.load(KvSnapshot(worker_id="w", seq=9, block_hashes=("a", "c"), taken_at=0))
    assert holders.matched(["a", "c"]) == {"w": 2}
    index.drop()
    assert holders.matched(["a"]) == {}


def test_slots_are_given_back_and_reused() -> None:
    holders = BlockHolders()
    holders.add("a", ["x", "y"])
    holders.add("b", ["x"])
    holders.remove("a", ["x", "y"])
    assert holders.slot("a") is None, "a worker holding nothing keeps no slot"
    holders.add("c", ["x", "z"])
    assert holders.width == 2, "the freed slot is taken by the next worker"
    assert holders.matched(["x", "z"]) == {"b": 1, "c": 2}
    depths = holders.depths(["x", "z"])
    b, c = holders.slot("b"), holders.slot("c")
    assert b is not None
    assert c is not None
    assert (depths[b], depths[c]) == (1.0, 2.0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "leave", "store", "evict"]), st.integers(0, 9), st.integers(0, 11)
        ),
        max_size=60,
    )
)
def test_the_views_matched_column_is_each_workers_own_match(steps: list[tuple[str, int, int]]) -> None:
    """Workers join and leave the table (rows move), store and evict blocks (slots are taken and given
    back): each row's matched figure stays that worker's own prefix match."""
    view = WorkerView(aioredis.Redis(), Names(), "p")
    chain = [f"b{i}" for i in range(12)]
    seqs: dict[str, int] = {}
    for op, w, cut in steps:
        wid = f"w{w}"
        if op == "join":
            view.on_heartbeat(_heartbeat(wid))
            if wid not in view.precise:
                view.precise[wid] = PreciseIndex(wid, view.holders)
                view.precise[wid].apply(event(1, KvEventKind.CLEARED))
                seqs[wid] = 1
        elif op == "leave":
            view.forget(wid)
            seqs.pop(wid, None)
        elif wid in view.precise:
            seqs[wid] += 1
            kind = KvEventKind.STORED if op == "store" else KvEventKind.REMOVED
            blocks = chain[:cut] if op == "store" else chain[cut:]
            view.precise[wid].apply(event(seqs[wid], kind, *blocks))
        view._imprecise_cache = None
        for cut_at in (0, 3, 12):
            prompt = chain[:cut_at]
            column = view.matched_column(prompt)
            assert len(column) == len(view.table)
            for row, worker_id in enumerate(view.table.ids):
                assert column[row] == view.matched(worker_id, prompt)


def _heartbeat(worker_id: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, pool="p", model="m", state=WorkerState.READY, seq=1, sent_at=1.0,
        ttl_ms=3000, kv_blocks_total=100, kv_blocks_free=100, block_size=16, running=0, waiting=0,
        inbox_pending=0, decode_tokens_per_s=0.0, started_at=0.0, kv_events=True,
    )  # fmt: skip
