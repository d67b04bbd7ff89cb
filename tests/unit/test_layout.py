"""The dependency direction of DESIGN: the contract (queue_schemas) imports nothing of sluice's and no I/O
library; the shared packages (plumbing, openai_api) import the contract and each other, never a service;
services import the contract and the shared packages, never each other; infra imports the services."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("ingress", "dispatcher", "gpu_workers", "scaler")
SHARED = ("plumbing", "openai_api")
FIRST_PARTY = ("queue_schemas", *SHARED, *SERVICES, "infra", "bench", "tests")
# Libraries that open connections, start loops, serve, or load engines and tokenizers.
IO_LIBRARIES = {
    "redis", "aiokafka", "kafka", "boto3", "botocore", "httpx", "aiohttp", "requests", "urllib", "http",
    "socket", "socketserver", "wsgiref", "asyncio", "threading", "concurrent", "subprocess", "fastapi",
    "starlette", "sse_starlette", "uvicorn", "prometheus_client", "transformers", "tokenizers",
    "huggingface_hub", "kubernetes", "vllm", "torch",
}  # fmt: skip


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


def test_the_contract_imports_no_io_library_and_no_other_sluice_package() -> None:
    imported = imported_top_levels("queue_schemas")
    assert imported & IO_LIBRARIES == set()
    assert imported & (set(FIRST_PARTY) - {"queue_schemas"}) == set()


@pytest.mark.parametrize("package", SHARED)
def test_the_shared_packages_import_no_service(package: str) -> None:
    assert (ROOT / package / "__init__.py").is_file()
    assert imported_top_levels(package) & {*SERVICES, "infra", "bench", "tests"} == set()


def test_no_module_outside_the_protocol_package_defines_a_lua_script() -> None:
    protocol = ROOT / "plumbing" / "protocol"
    outside = []
    for package in set(FIRST_PARTY) - {"tests"}:
        for path in (ROOT / package).rglob("*.py"):
            if path.is_relative_to(protocol):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and "redis.call(" in node.value
                ):
                    outside.append(str(path.relative_to(ROOT)))
    assert outside == []
