"""How the suite is split into pytest-xdist's units of work (tests/conftest.py)."""

from __future__ import annotations

from tests.conftest import E2E_SCOPE, ENGINE_SCOPE, STACKS_SCOPE, scope_rank, work_scope


def test_every_test_that_starts_vllm_is_one_unit() -> None:
    ids = [
        "tests/engine/test_vllm_engine.py::test_a",
        "tests/e2e/smollm2/test_worker_kill.py::test_b",
        "tests/e2e/test_lora.py::test_c",
        "tests/e2e/test_dev_command.py::test_d",
    ]
    assert {work_scope(nodeid) for nodeid in ids} == {ENGINE_SCOPE}


def test_the_shared_stack_tests_and_the_whole_stack_tiers_are_units_of_their_own() -> None:
    assert work_scope("tests/e2e/test_resume.py::test_x") == E2E_SCOPE
    assert work_scope("tests/chaos/test_service_faults.py::test_x") == STACKS_SCOPE
    assert work_scope("tests/cluster/test_cluster_stack.py::test_y[a]") == STACKS_SCOPE


def test_any_other_test_goes_with_its_module() -> None:
    assert work_scope("tests/unit/test_codec.py::test_x[1]") == "tests/unit/test_codec.py"
    assert work_scope("tests/integration/test_failover.py::test_y") == "tests/integration/test_failover.py"


def test_units_go_out_vllm_first_then_unit_tier_then_e2e_then_the_rest() -> None:
    scopes = [STACKS_SCOPE, "tests/integration/test_failover.py", E2E_SCOPE, "tests/unit/test_codec.py"]
    scopes.append(ENGINE_SCOPE)
    assert sorted(scopes, key=scope_rank) == [
        ENGINE_SCOPE,
        "tests/unit/test_codec.py",
        E2E_SCOPE,
        STACKS_SCOPE,
        "tests/integration/test_failover.py",
    ]
