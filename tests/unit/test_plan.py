"""`sluice plan` arithmetic against values computed by hand."""

from dataclasses import replace

import pytest

from scaler.plan import GPUS, MODELS, ControlFigures, ControlTraffic, Deployment, Workload, control_plan, plan

GIB = 1024**3


def test_70b_on_h100_chain() -> None:
    p = plan(MODELS["llama-70b"], GPUS["h100"], Workload(), Deployment())
    # 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes = 327,680 B = 320 KiB
    assert p.kv_bytes_per_token == 327_680
    # 4 GPUs x 80 GiB x 0.90 = 288 GiB; minus 141.2e9 B of weights and 4 x 3 GiB overhead
    assert p.kv_budget_bytes == 276 * GIB - 141.2e9 == 155_152_743_424
    assert p.kv_token_capacity == 473_488  # floor(155,152,743,424 / 327,680)
    assert p.concurrent_per_replica == 205  # floor(473,488 / 2,300)
    assert p.request_seconds == pytest.approx(12.8)  # 0.8 + 300 / 25
    assert p.requests_per_s_per_replica == pytest.approx(16.015625)  # 205 / 12.8
    assert p.replicas == 2  # ceil(20 x 1.3 / 16.015625)
    assert p.gpus == 8
    # 4 x $2.50 per hour / (16.015625 x 300 x 3600 output tokens per hour) x 1e6
    assert p.cost_per_million_output_tokens == pytest.approx(0.578139, rel=1e-5)
    assert p.steps()[0][:2] == ("KV bytes per token", "320 KiB")


def test_max_num_seqs_caps_concurrency_and_overrides_apply() -> None:
    p = plan(MODELS["llama-8b"], GPUS["h200"], Workload(prompt_tokens=200, output_tokens=100), Deployment(1))
    assert p.concurrent_per_replica == 256


def test_a_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        plan(MODELS["llama-70b"], GPUS["h100"], Workload(), Deployment(tensor_parallel=1))


def test_the_scaler_can_take_its_capacity_default_from_the_plan() -> None:
    from queue_schemas.config import ScalingConfig
    from scaler.service import capacity_default

    assert capacity_default(ScalingConfig(requests_per_replica_s=3.0)) == 3.0
    planned = capacity_default(ScalingConfig(plan_model="llama-70b", plan_gpu="h100", plan_tensor_parallel=4))
    assert planned == pytest.approx(16.015625)
    with pytest.raises(ValueError, match="unknown plan preset"):
        capacity_default(ScalingConfig(plan_model="gpt-99"))


def test_sluice_plan_prints_the_chain() -> None:
    from typer.testing import CliRunner

    from infra.cli import app

    result = CliRunner().invoke(app, ["plan", "--model", "llama-70b", "--gpu", "h100"])
    assert result.exit_code == 0, result.output
    for expected in ("320 KiB", "473,488", "205", "16.02", "$0.58"):
        assert expected in result.output
    unknown = CliRunner().invoke(app, ["plan", "--model", "nope"])
    assert unknown.exit_code == 2


def test_lora_slots_come_out_of_the_kv_budget() -> None:
    m = MODELS["llama-70b"]
    # q and v at rank 16: 16 x ((8192 + 8192) + (8192 + 1024)) per layer x 80 layers x 2 B = 65,536,000 B
    assert m.adapter_bytes(16, ("q_proj", "v_proj")) == 65_536_000
    slots = Deployment(max_loras=8, lora_rank=16, lora_modules=("q_proj", "v_proj"))
    with_loras = plan(m, GPUS["h100"], Workload(), slots)
    without = plan(m, GPUS["h100"], Workload(), Deployment())
    assert without.kv_budget_bytes - with_loras.kv_budget_bytes == 8 * 65_536_000
    assert with_loras.kv_token_capacity == (155_152_743_424 - 8 * 65_536_000) // 327_680
    assert any(row[0] == "LoRA adapter slots" for row in with_loras.steps())
    assert not any(row[0].startswith("LoRA") for row in without.steps())
    with pytest.raises(ValueError, match="unknown LoRA target module"):
        m.adapter_bytes(8, ("lm_head",))


def test_control_plane_against_hand_arithmetic() -> None:
    figures = ControlFigures(
        chunks_per_shard_s=50_000, replay_bytes_per_token=100, chunks_per_ingress_core_s=4_000,
        requests_per_ingress_core_s=100, ingress_kib_per_stream=64, placements_per_dispatcher_core_s=500,
        requests_per_partition_s=1_000, utilization=0.5,
    )  # fmt: skip
    traffic = ControlTraffic(
        open_streams=100_000, requests_per_s=5_000, tokens_per_stream_s=20, requests_per_worker=128,
        log_after_end_s=60, pools=2, ingress_cores=4, ingress_memory_gib=2, shard_memory_gib=10,
    )  # fmt: skip
    p = control_plan(traffic, figures)
    assert p.window_s == pytest.approx(0.1)  # 15 ms x 128 / 16 = 120 ms, at most 100 ms
    assert p.chunks_per_stream_s == pytest.approx(10)  # a token every 50 ms, a chunk every 100 ms
    assert p.chunks_per_s == pytest.approx(1_000_000)  # 100,000 x 10
    assert p.shards_for_throughput == 40  # 1e6 / (50,000 x 0.5)
    assert p.seconds_per_stream == 20  # 100,000 / 5,000
    # 400 tokens an answer: 100,000 open x 200 + 5,000/s x 60 s x 400
    assert p.logged_tokens == 20_000_000 + 120_000_000
    assert p.replay_memory_gib == pytest.approx(140_000_000 * 100 / GIB)  # 13.0 GiB
    assert p.shards_for_memory == 3  # 13.04 / (10 x 0.5)
    assert p.shards == 40
    assert p.dispatchers_per_pool == 10  # 2,500 req/s per pool / (500 x 0.5)
    assert p.partitions_per_pool == 20  # max(ceil(2,500 / 1,000) = 3, 2 x 10)
    assert p.ingress_cores_needed == pytest.approx((1_000_000 / 4_000 + 5_000 / 100) / 0.5)  # 600
    assert p.ingress_for_cpu == 150  # 600 / 4
    assert p.ingress_for_memory == 7  # 100,000 x 64 KiB = 6.1 GiB / (2 GiB x 0.5)
    assert p.ingress_replicas == 150
    assert len(p.steps()) == 13
    # A lightly loaded worker keeps its 15 ms window, and a slow stream sends a chunk a token.
    light = control_plan(replace(traffic, requests_per_worker=8, tokens_per_stream_s=20), figures)
    assert light.chunks_per_stream_s == 20
    fast = control_plan(replace(traffic, requests_per_worker=8, tokens_per_stream_s=200), figures)
    assert fast.chunks_per_stream_s == pytest.approx(1 / 0.015)
    with pytest.raises(ValueError, match="requests per second"):
        control_plan(ControlTraffic(open_streams=10, requests_per_s=0))


def test_sluice_plan_prints_the_control_plane() -> None:
    from typer.testing import CliRunner

    from infra.cli import app

    argv = ["plan", "--open-streams", "1000000", "--requests-per-s", "50000"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert "1,000,000 open streams" in result.output
    assert "Redis shards (primaries)" in result.output
