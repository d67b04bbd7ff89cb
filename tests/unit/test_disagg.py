"""Prefill/decode disaggregation: the split decision, the prefill worker's choice, the handoff's pure
parts (connector parameters, KV folders, the sweep), prefill sizing and the configuration's rules."""

from __future__ import annotations

import importlib.util
import os
import random
import secrets
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from dispatcher.disagg import PrefillSide, SplitCase, choose_prefill, costs, decide_split, split_case
from dispatcher.view import WorkerView
from gpu_workers.handoff import (
    KvTransfer,
    PrefillRate,
    kv_folder,
    parse_params,
    remove_kv,
    sweep,
    transfer_params,
)
from gpu_workers.prefill import expected_rows, prefill_request, saved_rows
from gpu_workers.vllm_args import HANDOFF_CONNECTOR_MODULE, engine_arguments
from queue_schemas.config import HANDOFF_CONNECTOR, DisaggregationConfig, PoolConfig, PrefillGroup
from queue_schemas.messages import Handoff, Heartbeat, InferenceRequest, KvRole, SamplingParams, WorkerState
from queue_schemas.names import Names
from scaler.policy import prefill_target

NOW = 1000.0
AUTO = DisaggregationConfig(transfer_fixed_s=0.05, transfer_s_per_token=0.0001, min_uncached_tokens=256)


def beat(
    worker_id: str,
    role: KvRole = "decode",
    *,
    running: int = 0,
    rate: float = 0.0,
    backlog: int = 0,
    state: WorkerState = WorkerState.READY,
    age: float = 0.1,
) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id, pool="sim", model="m", state=state, seq=1, sent_at=NOW - age, ttl_ms=3000,
        kv_blocks_total=1000, kv_blocks_free=1000, block_size=16, running=running, waiting=0,
        inbox_pending=0, decode_tokens_per_s=0.0, started_at=0.0, role=role, prefill_tokens_per_s=rate,
        prefill_backlog=backlog,
    )  # fmt: skip


def case(**fields: float) -> SplitCase:
    base = {"prompt_tokens": 4000, "decode_cached": 0, "decode_running": 8, "decode_rate": 4000.0}
    base.update(prefill_rate=4000.0)
    base.update(fields)
    return SplitCase(**base)  # type: ignore[arg-type]


# the decision
def test_a_long_uncached_prompt_on_a_busy_decode_worker_is_split() -> None:
    verdict = decide_split(case(), AUTO)
    assert verdict.split
    assert verdict.reason == "split is cheaper"
    # Local: 1 s of prefill, stalling 8 running requests a second each; split: 1 s on the prefill worker
    # plus a 0.45 s transfer, which stalls the 8 for 0.45 s each.
    assert verdict.local_s == pytest.approx(1.0 + 8 * 1.0)
    assert verdict.split_s == pytest.approx(1.0 + 0.45 + 8 * 0.45)


def test_on_an_idle_decode_worker_the_prompt_prefills_where_it_decodes() -> None:
    verdict = decide_split(case(decode_running=0), AUTO)
    assert not verdict.split
    assert verdict.reason == "local is cheaper"


def test_requests_waiting_at_the_decode_worker_count_against_a_local_prefill() -> None:
    idle = case(decode_running=0)
    assert not decide_split(idle, AUTO).split
    # Two requests wait there: a local prefill of 1 s holds each of them up a second.
    verdict = decide_split(case(decode_running=0, decode_waiting=2), AUTO)
    assert verdict.local_s == pytest.approx(3.0)
    assert verdict.split


def test_a_cached_prefix_keeps_the_prefill_local() -> None:
    assert not decide_split(case(decode_cached=3900), AUTO).split  # 100 uncached tokens
    # Not so under llm-d's threshold rule on the uncached part either; but a threshold of 0 splits it.
    assert not decide_split(case(decode_cached=3900), AUTO.model_copy(update={"mode": "threshold"})).split
    assert decide_split(
        case(decode_cached=3900), AUTO.model_copy(update={"mode": "threshold", "threshold_tokens": 0})
    ).split


def test_a_prefill_worker_with_a_long_queue_is_not_worth_it() -> None:
    assert decide_split(case(prefill_backlog=0), AUTO).split
    assert not decide_split(case(prefill_backlog=60_000), AUTO).split  # 15 s of queue


def test_a_prefill_worker_that_holds_the_prefix_computes_less() -> None:
    slow = AUTO.model_copy(update={"stall_weight": 0.0})  # first-token time alone
    assert not decide_split(case(prefill_cached=0), slow).split
    assert decide_split(case(prefill_cached=3800), slow).split


def test_fixed_modes() -> None:
    for mode, split in (("always", True), ("never", False)):
        config = AUTO.model_copy(update={"mode": mode})
        assert decide_split(case(decode_running=0, prompt_tokens=20), config).split is split


def test_costs_are_seconds() -> None:
    local, split = costs(case(decode_running=0, prompt_tokens=2000), AUTO)
    assert local == pytest.approx(0.5)
    assert split == pytest.approx(0.5 + 0.05 + 0.2)


def test_an_unmeasured_decode_worker_is_taken_to_prefill_as_fast_as_the_prefill_worker() -> None:
    side = PrefillSide(beat("p0", "prefill", rate=3000.0, backlog=600), sent_tokens=400, matched_tokens=64)
    c = split_case(5000, beat("d0", running=3), 1024, side, AUTO, decode_waiting=2)
    assert (c.decode_rate, c.prefill_rate, c.prefill_backlog, c.prefill_cached) == (3000.0, 3000.0, 1000, 64)
    assert c.decode_running == 3
    assert c.decode_waiting == 2
    assert c.decode_cached == 1024
    unmeasured = split_case(5000, beat("d0"), 0, PrefillSide(beat("p0", "prefill")), AUTO)
    assert unmeasured.decode_rate == unmeasured.prefill_rate == AUTO.prefill_tokens_per_s


# the prefill worker
def test_the_prefill_worker_that_finishes_soonest_is_chosen() -> None:
    rng = random.Random(1)
    sides = [
        PrefillSide(beat("p0", "prefill", rate=1000.0, backlog=2000)),  # 2 s queued
        PrefillSide(beat("p1", "prefill", rate=4000.0, backlog=4000)),  # 1 s queued, 4x faster
        PrefillSide(beat("p2", "prefill", rate=1000.0, state=WorkerState.DRAINING)),
        PrefillSide(beat("p3", "prefill", rate=9000.0, age=10.0)),  # stale
        PrefillSide(beat("d0", "decode", rate=9000.0)),
    ]
    chosen = choose_prefill(sides, 1000, NOW, AUTO, rng)
    assert chosen is not None
    assert chosen.worker_id == "p1"
    assert choose_prefill(sides[2:], 1000, NOW, AUTO, rng) is None


def test_the_view_never_places_a_request_on_a_prefill_worker() -> None:
    view = WorkerView(None, Names(), "sim")  # type: ignore[arg-type]
    view.on_heartbeat(beat("d0"))
    view.on_heartbeat(beat("p0", "prefill", rate=2000.0))
    assert [w.worker_id for w in view.snapshot([])] == ["d0"]
    assert view.table.ids == ["d0"]
    assert view.waiting("d0") == 0
    view.record_placement("d0", 4, ["x"])
    assert view.waiting("d0") == 1
    view.record_prefill("p0", 700, ["a", "b"])
    [side] = view.prefill_sides(["a", "b", "c"])
    assert (side.worker_id, side.sent_tokens, side.matched_tokens) == ("p0", 700, 32)


# the handoff's pure parts
def test_connector_parameters_round_trip_and_refuse_anything_else() -> None:
    hid = secrets.token_hex(16)
    for save in (True, False):
        kv = KvTransfer(hid, save)
        assert parse_params(transfer_params(kv)) == kv
    assert parse_params(None) is None
    assert parse_params({"sluice_handoff": "../../etc", "load": True}) is None
    assert parse_params({"sluice_handoff": hid}) is None
    assert parse_params({"sluice_handoff": hid, "load": "yes"}) is None


def test_an_engine_to_engine_connector_gets_the_prefill_s_own_parameters() -> None:
    hid = secrets.token_hex(16)
    assert transfer_params(KvTransfer(hid, True), shared_storage=False) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    remote = {
        "remote_engine_id": "e1",
        "remote_block_ids": [3, 4],
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
    }
    decode = transfer_params(KvTransfer(hid, False, remote), shared_storage=False)
    assert decode == {**remote, "do_remote_prefill": True, "do_remote_decode": False}


def test_kv_folders_are_named_by_handoff_id_only(tmp_path: Path) -> None:
    hid = secrets.token_hex(16)
    assert kv_folder(tmp_path, hid) == tmp_path / hid
    with pytest.raises(ValueError, match="not a handoff id"):
        kv_folder(tmp_path, "../x")
    (tmp_path / hid).mkdir()
    assert remove_kv(tmp_path, hid)
    assert not (tmp_path / hid).exists()
    assert not remove_kv(tmp_path, hid)


def test_the_sweep_removes_only_old_handoff_folders(tmp_path: Path) -> None:
    old, new = secrets.token_hex(16), secrets.token_hex(16)
    for name in (old, new, "not-a-handoff"):
        (tmp_path / name).mkdir()
    os.utime(tmp_path / old, (NOW - 600, NOW - 600))
    os.utime(tmp_path / new, (NOW - 10, NOW - 10))
    os.utime(tmp_path / "not-a-handoff", (NOW - 600, NOW - 600))
    assert sweep(tmp_path, 300, NOW) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([new, "not-a-handoff"])
    assert sweep(tmp_path / "absent", 300, NOW) == 0


def test_saved_rows_are_read_from_the_safetensors_headers(tmp_path: Path) -> None:
    for layer in range(3):
        save_file({"kv_cache": torch.zeros(256, 2, 4)}, str(tmp_path / f"layer.{layer}.safetensors"))
    assert saved_rows(tmp_path) == {256}
    assert expected_rows(300, 128) == 256
    assert expected_rows(257, 128) == 256
    assert expected_rows(256, 128) == 128


def test_the_prefill_job_runs_the_prompt_alone_for_one_token() -> None:
    request = InferenceRequest(
        request_id="req-0000000001", pool="sim", model="m", team="t", prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=50, temperature=0.9, stop=("x",)), created_at=0.0, deadline=9.0,
        handoff=Handoff(id=secrets.token_hex(16), prefill_worker="p0", wait_s=5),
    )  # fmt: skip
    job = prefill_request(request)
    assert job.sampling == SamplingParams(max_tokens=1, temperature=0.0)
    assert job.handoff is None
    assert job.prompt_token_ids == request.prompt_token_ids


def test_the_prefill_rate_is_averaged_over_jobs() -> None:
    rate = PrefillRate(weight=0.5)
    rate.record(1000, 0.5)
    assert rate.tokens_per_s == 2000.0
    rate.record(1000, 0.25)
    assert rate.tokens_per_s == 3000.0
    rate.record(0, 1.0)
    assert rate.tokens_per_s == 3000.0


# sizing and configuration
def test_prefill_replicas_follow_the_decode_replicas_within_bounds() -> None:
    group = PrefillGroup(min_replicas=1, max_replicas=3, per_decode=0.5)
    assert [prefill_target(group, n) for n in (0, 1, 2, 3, 4, 8)] == [1, 1, 1, 2, 2, 3]
    with pytest.raises(ValidationError):
        PrefillGroup(min_replicas=3, max_replicas=2)


def pool(**fields: object) -> PoolConfig:
    return PoolConfig.model_validate({"name": "p", "model": "m", **fields})


def test_a_pool_splits_only_with_prefill_workers_and_a_connector() -> None:
    with pytest.raises(ValidationError, match=r"needs \[pools.scaling.prefill\]"):
        pool(disaggregation={})
    assert pool(disaggregation={"mode": "never"}).splits is False
    assert pool(disaggregation={}, scaling={"prefill": {}}).splits is True
    vllm = {"source": "/m"}
    with pytest.raises(ValidationError, match="kv_connector"):
        pool(engine="vllm", vllm=vllm, disaggregation={}, scaling={"prefill": {}})
    with pytest.raises(ValidationError, match="no adapters"):
        pool(disaggregation={}, scaling={"prefill": {}}, adapters=[{"name": "a", "source": "/a"}])


def test_the_handoff_connector_is_loaded_from_sluice_and_a_prefill_step_takes_a_whole_prompt() -> None:
    connector = {"connector": HANDOFF_CONNECTOR, "extra": {"shared_storage_path": "/kv"}}
    config = pool(
        engine="vllm", block_size=128, vllm={"source": "/m", "kv_connector": connector},
        disaggregation={}, scaling={"prefill": {}},
    )  # fmt: skip
    assert config.vllm is not None
    assert config.vllm.handoff_storage == Path("/kv")
    prefill = engine_arguments(config, Path("/m"), False, None, on_gpu=False, role="prefill")
    transfer = prefill["kv_transfer_config"]
    assert transfer["kv_connector_module_path"] == HANDOFF_CONNECTOR_MODULE
    assert importlib.util.find_spec(HANDOFF_CONNECTOR_MODULE) is not None  # a module vLLM can import
    assert transfer["kv_role"] == "kv_producer"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert prefill["max_num_batched_tokens"] == config.context_tokens
    decode = engine_arguments(config, Path("/m"), False, None, on_gpu=False, role="decode")
    assert decode["kv_transfer_config"]["kv_role"] == "kv_consumer"
    assert "max_num_batched_tokens" not in decode
