"""Prompt tokenization with each pool's own tokenizer, so the prompt token count is exact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ingress.openai_types import ChatMessage
from queue_schemas.config import PoolConfig


class ChatTokenizer(Protocol):
    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Render the pool's chat template with the generation prompt and return its token ids."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256) with a ChatML template: the simulated engine's tokenizer."""

    def render(self, messages: Sequence[ChatMessage]) -> str:
        turns = [f"<|im_start|>{m.role}\n{m.text()}<|im_end|>\n" for m in messages]
        return "".join(turns) + "<|im_start|>assistant\n"

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return list(self.render(messages).encode())


def tokenizer_for(pool: PoolConfig) -> ChatTokenizer:
    if pool.tokenizer == "bytes":
        return ByteTokenizer()
    raise ValueError(f"pool {pool.name}: unknown tokenizer {pool.tokenizer!r}")
