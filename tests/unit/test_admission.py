import pytest

from openai_api.admission import build_request, partition_key
from openai_api.errors import InvalidRequest
from openai_api.openai_types import ChatCompletionRequest
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.config import PoolConfig

POOL = PoolConfig(name="sim", model="sluice-sim", context_tokens=200, default_max_tokens=50, block_size=16)
TEAM = "dev"


def chat(**fields: object) -> ChatCompletionRequest:
    body: dict[str, object] = {"model": "sluice-sim", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return ChatCompletionRequest.model_validate(body)


def admit(c: ChatCompletionRequest, prompt_len: int = 20) -> object:
    return build_request(c, POOL, TEAM, list(range(prompt_len)), request_id="r" * 32, now=100.0, timeout_s=30)


def test_request_carries_prompt_sampling_and_deadline() -> None:
    req = build_request(
        chat(temperature=0.5, stop="x", max_tokens=10), POOL, TEAM, list(range(40)),
        request_id="r" * 32, now=100.0, timeout_s=30,
    )  # fmt: skip
    assert req.prompt_token_ids == tuple(range(40))
    assert len(req.block_hashes) == 2
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.stop) == (10, 0.5, ("x",))
    assert req.deadline == 130.0
    assert partition_key(req) == req.block_hashes[0].encode()


def test_default_max_tokens_is_bounded_by_the_context() -> None:
    req = build_request(chat(), POOL, TEAM, list(range(180)), request_id="r" * 32, now=0.0, timeout_s=1)
    assert req.sampling.max_tokens == 20


def test_too_long_is_refused_with_context_length_exceeded() -> None:
    with pytest.raises(InvalidRequest) as err:
        admit(chat(max_completion_tokens=190))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        admit(chat(), prompt_len=200)


def test_short_prompt_is_keyed_by_request_id() -> None:
    req = build_request(chat(), POOL, TEAM, [1, 2], request_id="r" * 32, now=0.0, timeout_s=1)
    assert req.block_hashes == ()
    assert partition_key(req) == b"r" * 32


def test_byte_tokenizer_renders_chatml_and_counts_bytes() -> None:
    msgs = chat(messages=[{"role": "system", "content": "é"}, {"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]).messages  # fmt: skip
    text = ByteTokenizer().render(msgs)
    assert text == "<|im_start|>system\né<|im_end|>\n<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n"
    assert ByteTokenizer().encode_chat(msgs) == list(text.encode())
