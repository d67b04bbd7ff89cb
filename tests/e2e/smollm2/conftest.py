"""One `sluice dev` on real SmolLM2 for the modules of this package: a split pool (one prefill and one
decode worker handing KV over through the shared-storage handoff connector) and a single pool of two
workers. The modules that kill a worker run last (file order); each test first waits for the workers it
needs to be ready, so none depends on what an earlier test left."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.models import prepare_smollm2
from tests.e2e.dev_cli import DevRun, sluice_dev, wait_ready

MODELS = Path(__file__).parents[3] / ".sluice" / "models"
POOL = """
[[pools]]
name = "{name}"
model = "{name}"
engine = "vllm"
context_tokens = 2048
block_size = 128
queue_timeout_s = 300
[pools.vllm]
source = "{source}"
kv_cache_gib = 0.25
max_num_seqs = 4
cpu_threads = 1
"""
SPLIT = """
[pools.vllm.kv_connector]
connector = "SluiceHandoffConnector"
extra = {{ shared_storage_path = "{kv}" }}
[pools.scaling]
min_replicas = 1
max_replicas = 1
[pools.scaling.prefill]
min_replicas = 1
max_replicas = 1
[pools.disaggregation]
mode = "threshold"        # the decision's other modes are the unit tests' and the simulator's
threshold_tokens = 512
handoff_wait_s = 120
"""
SINGLE = """
[pools.scaling]
min_replicas = 2
max_replicas = 2
startup_s = 60
"""


@pytest.fixture(scope="package")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevRun]:
    tmp = tmp_path_factory.mktemp("smollm2")
    source = prepare_smollm2(MODELS / "smollm2-135m-instruct", MODELS / "downloads").resolve()
    config = tmp / "pools.toml"
    config.write_text(
        POOL.format(name="split", source=source)
        + SPLIT.format(kv=tmp / "kv")
        + POOL.format(name="single", source=source)
        + SINGLE
    )
    with sluice_dev(tmp, "--config", str(config), "--dispatchers", "1") as dev:
        asyncio.run(wait_ready(dev.env["SLUICE_REDIS_URL"], {"split": 2, "single": 2}))
        yield dev
