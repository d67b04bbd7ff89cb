"""`sluice plan` arithmetic against values computed by hand."""

import pytest

from scaler.plan import GPUS, MODELS, Deployment, Workload, plan

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
