"""The dependency direction of DESIGN: services import only queue_schemas; infra imports the services."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ingress", "dispatcher", "gpu_workers", "scaler")


def imported_top_levels(package: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("service", SERVICES)
def test_services_do_not_import_each_other_or_infra(service: str) -> None:
    forbidden = (set(SERVICES) - {service}) | {"infra"}
    assert imported_top_levels(service) & forbidden == set()


def test_queue_schemas_imports_no_service() -> None:
    assert imported_top_levels("queue_schemas") & {*SERVICES, "infra"} == set()
