"""The pure parts around the vLLM engine: KV event translation, engine and sampling arguments, figures."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_workers.engine import EngineError, StartFailed
from gpu_workers.kv_translate import KvTranslator
from gpu_workers.vllm_args import (
    cpu_environment,
    cpu_thread_binding,
    engine_arguments,
    finish_reason,
    lora_arguments,
    sampling_arguments,
    speculative_config,
)
from gpu_workers.vllm_lora import check_adapter, zero_adapter
from gpu_workers.vllm_stats import EngineFigures
from infra.install_engine import cpu_requirements
from plumbing.model_store import ModelSourceError
from queue_schemas.config import AdapterConfig, ConfigError, PoolConfig, VllmEngineConfig, parse_config
from queue_schemas.messages import (
    FinishReason,
    InferenceRequest,
    KvEventKind,
    SamplingParams,
    StructuredOutput,
)
from queue_schemas.prefix import block_hashes


def test_chain_continues_from_a_parent() -> None:
    tokens = list(range(40))
    whole = block_hashes(tokens, 8)
    assert block_hashes(tokens[16:], 8, parent_hash=whole[1]) == whole[2:]


def test_translator_names_blocks_by_the_chain_hash() -> None:
    tokens = list(range(1, 33))
    ours = block_hashes(tokens, 8)
    t = KvTranslator(8)
    assert t.stored([101, 102], None, tokens[:16]) == (KvEventKind.STORED, tuple(ours[:2]))
    assert t.stored([103, 104], 102, tokens[16:]) == (KvEventKind.STORED, tuple(ours[2:]))
    # Stored again (another request re-filled the same blocks): nothing new to announce.
    assert t.stored([103], 102, tokens[16:24]) is None
    assert t.removed([101, 999]) == (KvEventKind.REMOVED, (ours[0],))
    assert len(t) == 3


def test_translator_skips_blocks_whose_parent_was_never_seen() -> None:
    t = KvTranslator(8)
    assert t.stored([7], 6, list(range(8))) is None
    assert t.skipped == 1
    assert t.stored([7, 8], None, list(range(12))) is None  # 12 tokens do not make two full blocks
    assert t.cleared() == (KvEventKind.CLEARED, ())


def test_cpu_threads_split_per_rank() -> None:
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding([0, 1, 2, 3, 4, 5, 6, 7], 2) == "0-3|4-7"
    with pytest.raises(StartFailed, match="needs at least as many CPU cores"):
        cpu_thread_binding([0], 2)


def test_engines_that_share_a_host_are_not_all_bound_to_its_first_core() -> None:
    shared = VllmEngineConfig(source="/models/small", cpu_threads=1)
    assert cpu_environment(shared, [0, 1], 1) == {
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # no binding to set up: no worker process for it
    }
    alone = VllmEngineConfig(source="/models/small")
    assert cpu_environment(alone, [0, 1], 1) == {"OMP_NUM_THREADS": "2"}  # vLLM binds automatically
    ranks = cpu_environment(shared, [0, 1, 2, 3], 2)
    assert ranks == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    connector = VllmEngineConfig.model_validate(
        {"source": "/models/small", "kv_connector": {"connector": "SluiceHandoffConnector"}}
    )
    assert cpu_environment(connector, [0, 1], 1)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def _pool(**vllm: object) -> PoolConfig:
    return PoolConfig(
        name="small",
        model="small",
        engine="vllm",
        block_size=128,
        context_tokens=2048,
        tensor_parallel_size=2,
        vllm=VllmEngineConfig(source="/models/small", **vllm),  # type: ignore[arg-type]
    )


def test_engine_arguments_follow_the_pool() -> None:
    args = engine_arguments(_pool(kv_cache_gib=0.5), Path("/m"), spec_decoding=False, kv_endpoint="tcp://x:1")
    assert args["model"] == "/m"
    assert args["block_size"] == 128
    assert args["max_model_len"] == 2048
    assert args["tensor_parallel_size"] == 2
    assert args["enable_prefix_caching"] is True
    assert args["kv_cache_memory_bytes"] == 1 << 29
    assert args["speculative_config"] is None
    assert args["kv_events_config"]["endpoint"] == "tcp://x:1"
    assert args["dtype"] == "auto", "vLLM chooses on a GPU"
    assert args["scheduling_policy"] == "priority"


def test_auto_precision_on_a_cpu_is_float32_and_a_chosen_one_stands() -> None:
    on_cpu = engine_arguments(_pool(), Path("/m"), spec_decoding=False, kv_endpoint=None, on_gpu=False)
    assert on_cpu["dtype"] == "float32"
    chosen = engine_arguments(_pool(dtype="bfloat16"), Path("/m"), False, None, on_gpu=False)
    assert chosen["dtype"] == "bfloat16"


def test_only_an_unbound_one_rank_engine_on_cpu_runs_its_model_in_the_engine_core() -> None:
    def backend(tp: int, on_gpu: bool, **vllm: object) -> object:
        pool = _pool(**vllm).model_copy(update={"tensor_parallel_size": tp})
        args = engine_arguments(pool, Path("/m"), False, None, on_gpu=on_gpu)
        return args.get("distributed_executor_backend")

    assert backend(1, False, cpu_threads=1) == "uni"
    assert backend(1, False) is None, "a bound engine keeps vLLM's worker process, which binds it"
    assert backend(2, False, cpu_threads=1) is None, "ranks are processes"
    assert backend(1, True, cpu_threads=1) is None, "vLLM's choice on a GPU"
    alone = VllmEngineConfig(source="/models/small")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in cpu_environment(alone, [0, 1], 1)


def test_speculation_is_ngram_unless_a_draft_model_is_set() -> None:
    ngram = speculative_config(VllmEngineConfig(source="m"), enabled=True)
    assert ngram is not None
    assert ngram["method"] == "ngram"
    draft = speculative_config(VllmEngineConfig(source="m", draft_model="/d"), enabled=True)
    assert draft == {"model": "/d", "num_speculative_tokens": 3}
    assert speculative_config(VllmEngineConfig(source="m"), enabled=False) is None


def test_sampling_arguments_carry_every_field() -> None:
    request = InferenceRequest(
        request_id="r" * 16,
        pool="p",
        model="m",
        team="t",
        prompt_token_ids=(1, 2),
        sampling=SamplingParams(max_tokens=9, temperature=0.0, top_p=0.5, stop=("x",), seed=3),
        created_at=0.0,
        deadline=1.0,
    )
    args = sampling_arguments(request)
    assert args == {
        "structured": None,
        "max_tokens": 9,
        "temperature": 0.0,
        "top_p": 0.5,
        "stop": ["x"],
        "seed": 3,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }


def test_finish_reasons() -> None:
    assert finish_reason("length") is FinishReason.LENGTH
    assert finish_reason("stop") is FinishReason.STOP
    with pytest.raises(EngineError, match="abort"):
        finish_reason("abort")


def test_engine_figures_accumulate_counters_and_keep_the_latest_state() -> None:
    figures = EngineFigures()
    prefix = SimpleNamespace(reset=False, queries=256, hits=128)
    spec = SimpleNamespace(num_draft_tokens=6, num_accepted_tokens=4)
    step = SimpleNamespace(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.25,
        prefix_cache_stats=prefix,
        spec_decoding_stats=spec,
    )
    figures.record(step, SimpleNamespace(num_generation_tokens=10, num_preempted_reqs=2), now=100.0)
    figures.record(step, SimpleNamespace(num_generation_tokens=5, num_preempted_reqs=1), now=101.0)
    assert (figures.running, figures.waiting, figures.kv_usage) == (2, 1, 0.25)
    assert (figures.prefix_queries, figures.prefix_hits) == (512, 256)
    assert (figures.spec_drafted, figures.spec_accepted) == (12, 8)
    assert figures.preemptions == 3
    assert figures.tokens_per_s(now=102.0) == pytest.approx(3.0)
    assert figures.tokens_per_s(now=200.0) == 0.0


def test_cpu_requirements_drop_the_torch_family_and_other_platforms() -> None:
    metadata = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: regex",
            "Requires-Dist: torch==2.13.0",
            'Requires-Dist: torchvision; platform_machine != "riscv64"',
            'Requires-Dist: intel-openmp; platform_machine == "s390x"',
            'Requires-Dist: pytest; extra == "test"',
            "Requires-Dist: numba==0.65.0",
        ]
    )
    env = {"platform_machine": "x86_64", "python_version": "3.11", "sys_platform": "linux"}
    assert cpu_requirements(metadata, env) == ["regex", "numba==0.65.0"]


def test_vllm_pools_need_their_section_and_a_real_tokenizer() -> None:
    with pytest.raises(ConfigError, match=r"needs a \[pools.vllm\] section"):
        parse_config('[[pools]]\nname = "a"\nmodel = "a"\nengine = "vllm"\n')
    with pytest.raises(ConfigError, match="tokenizes with its model"):
        parse_config(
            '[[pools]]\nname = "a"\nmodel = "a"\nengine = "vllm"\ntokenizer = "bytes"\n'
            '[pools.vllm]\nsource = "/m"\n'
        )
    config = parse_config(
        '[[pools]]\nname = "a"\nmodel = "a"\nengine = "vllm"\n[pools.vllm]\nsource = "s3://b/m"\n'
    )
    assert config.pools[0].tokenizer_source == "s3://b/m"
    assert parse_config('[[pools]]\nname = "a"\nmodel = "a"\n').pools[0].tokenizer_source == "bytes"


def test_structured_outputs_become_vllm_guidance() -> None:
    def args_for(structured: StructuredOutput) -> object:
        sampling = SamplingParams(max_tokens=4, structured=structured)
        request = InferenceRequest(
            request_id="r" * 16, pool="p", model="m", team="t", prompt_token_ids=(1,),
            sampling=sampling, created_at=0.0, deadline=1.0,
        )  # fmt: skip
        return sampling_arguments(request)["structured"]

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert args_for(StructuredOutput(kind="json_schema", schema_text=json.dumps(schema))) == {"json": schema}
    assert args_for(StructuredOutput(kind="json_object")) == {"json_object": True}


def test_a_pool_with_adapters_enables_lora_with_a_rank_vllm_accepts_and_a_base_slot_on_cpu() -> None:
    adapters = [
        AdapterConfig(name="s-a", source="/a", rank=12),
        AdapterConfig(name="s-b", source="/b", rank=4),
    ]
    pool = _pool().model_copy(update={"adapters": tuple(adapters), "max_loras": 3})
    on_gpu = engine_arguments(pool, Path("/m"), spec_decoding=False, kv_endpoint=None, on_gpu=True)
    assert (on_gpu["enable_lora"], on_gpu["max_loras"], on_gpu["max_cpu_loras"]) == (True, 3, 3)
    assert on_gpu["max_lora_rank"] == 16  # 12 rounded up to a rank vLLM accepts
    assert lora_arguments(pool, on_gpu=False)["max_loras"] == 4  # one more, for the base adapter
    assert "enable_lora" not in engine_arguments(_pool(), Path("/m"), False, None, on_gpu=True)
    assert pool.adapter_id("s-b") == 2


def test_an_adapter_of_a_larger_rank_than_configured_is_refused_at_start(tmp_path: Path) -> None:
    folder = tmp_path / "adapter"
    folder.mkdir()
    adapter = AdapterConfig(name="s-a", source=str(folder), rank=8)
    with pytest.raises(ModelSourceError, match=r"unreadable adapter_config\.json"):
        check_adapter(adapter, folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    with pytest.raises(ModelSourceError, match="set rank = 16"):
        check_adapter(adapter, folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 4}))
    with pytest.raises(ModelSourceError, match="is not LORA"):
        check_adapter(adapter, folder)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    check_adapter(adapter, folder)


def test_the_zero_adapter_copies_the_shapes_and_is_made_again_when_they_change(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    like, dest = tmp_path / "like", tmp_path / "zero"
    like.mkdir()
    (like / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_file({"a": torch.ones(2, 4)}, str(like / "adapter_model.safetensors"))
    zero_adapter(like, dest)
    assert torch.equal(load_file(str(dest / "adapter_model.safetensors"))["a"], torch.zeros(2, 4))
    (like / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file({"a": torch.ones(4, 4)}, str(like / "adapter_model.safetensors"))
    zero_adapter(like, dest)
    assert load_file(str(dest / "adapter_model.safetensors"))["a"].shape == (4, 4)
    assert json.loads((dest / "adapter_config.json").read_text())["r"] == 4


def test_engines_starting_at_once_share_their_spawn_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_workers.vllm_engine import SpawnEnvironment

    monkeypatch.delenv("SLUICE_TEST_THREADS", raising=False)
    monkeypatch.setenv("SLUICE_TEST_SET_BEFORE", "mine")
    spawn = SpawnEnvironment()
    first = spawn.held({"SLUICE_TEST_THREADS": "1", "SLUICE_TEST_SET_BEFORE": "engine's"})
    second = spawn.held({"SLUICE_TEST_THREADS": "1"})
    first.__enter__()
    second.__enter__()
    assert os.environ["SLUICE_TEST_THREADS"] == "1"
    assert os.environ["SLUICE_TEST_SET_BEFORE"] == "mine", "a variable set before any engine stands"
    with pytest.raises(StartFailed, match="SLUICE_TEST_THREADS"), spawn.held({"SLUICE_TEST_THREADS": "2"}):
        pass
    first.__exit__(None, None, None)
    assert os.environ["SLUICE_TEST_THREADS"] == "1", "the second engine is still starting"
    second.__exit__(None, None, None)
    assert "SLUICE_TEST_THREADS" not in os.environ
    assert os.environ["SLUICE_TEST_SET_BEFORE"] == "mine"
