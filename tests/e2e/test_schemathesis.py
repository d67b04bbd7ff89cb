"""Property-based requests generated from the ingress's own OpenAPI schema: none may get a 5xx.

Positive (schema-valid) and negative (schema-violating) cases are generated for every operation; in a
third pass the generated bodies name a served model, so they travel the whole queue path.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from infra.devstack import Endpoints

Operation = schemathesis.APIOperation[Any, Any, Any, Any]
Case = schemathesis.Case[Any]

pytestmark = pytest.mark.timeout(900)

EXAMPLES_PER_OPERATION = 40
SERVED = ["sluice-sim", "sluice-tok"]


def operations(endpoints: Endpoints) -> list[Operation]:
    schema = schemathesis.openapi.from_url(endpoints.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]


def with_served_model(case: Case, model: str) -> Case:
    if isinstance(case.body, dict):
        body: dict[str, Any] = dict(case.body)
        body["model"] = model
        case.body = body
    return case


def run_cases(endpoints: Endpoints, strategy: st.SearchStrategy[Case]) -> None:
    @given(case=strategy)
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case: Case) -> None:
        response = case.call(
            base_url=endpoints.url, headers={"Authorization": f"Bearer {endpoints.api_key}"}, timeout=30
        )
        summary = (
            f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code}: {response.text[:300]}"
        )
        assert response.status_code < 500, summary

    check()


@pytest.mark.parametrize("mode", ["positive", "negative", "served-model"])
def test_no_server_errors(endpoints: Endpoints, mode: str) -> None:
    ops = operations(endpoints)
    assert {
        "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "POST /v1/files",
        "POST /v1/batches", "GET /v1/batches/{batch_id}", "POST /v1/responses",
        "GET /v1/responses/{response_id}", "POST /v1/responses/{response_id}/cancel",
    } <= {op.label for op in ops}  # fmt: skip
    posts = [op for op in ops if op.method.upper() == "POST"]
    if mode == "positive":
        for op in ops:
            run_cases(endpoints, op.as_strategy(generation_mode=GenerationMode.POSITIVE))
    elif mode == "negative":  # only operations that take a body can be sent a schema-violating one
        for op in (op for op in posts if list(op.body)):
            run_cases(endpoints, op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    else:
        for op in posts:
            cases = st.builds(with_served_model, op.as_strategy(), st.sampled_from(SERVED))
            run_cases(endpoints, cases)
