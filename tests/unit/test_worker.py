import time

from gpu_workers.starting import process_started_at, start_refusal
from queue_schemas.messages import InferenceRequest, SamplingParams


def request(**fields: object) -> InferenceRequest:
    base: dict[str, object] = {
        "request_id": "r" * 16, "pool": "p", "model": "m", "team": "t", "prompt_token_ids": (1,),
        "sampling": SamplingParams(max_tokens=1), "created_at": 0.0, "start_by": 10.0, "deadline": 20.0,
    }  # fmt: skip
    base.update(fields)
    return InferenceRequest.model_validate(base)


def test_start_refusals() -> None:
    assert start_refusal(request(), now=5.0) is None
    assert start_refusal(request(), now=11.0) == (
        "timeout",
        "no engine could start the request before its queue deadline",
    )


def test_process_start_time_is_this_process() -> None:
    age = time.time() - process_started_at()
    assert -1.5 <= age < 3600, f"this test process would have started {age:.0f} s ago"
