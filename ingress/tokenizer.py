"""Prompt tokenization with each pool's own tokenizer, so the prompt token count is exact."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ingress.errors import InvalidRequest
from ingress.openai_types import ChatMessage
from queue_schemas.config import PoolConfig
from queue_schemas.model_store import TOKENIZER_FILES, ModelSourceError, ModelStore


class PromptTokenizer(Protocol):
    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Render the pool's chat template with the generation prompt and return its token ids."""
        ...

    def encode_text(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256) with a ChatML template: the simulated engine's tokenizer."""

    def render(self, messages: Sequence[ChatMessage]) -> str:
        turns = [f"<|im_start|>{m.role}\n{m.text()}<|im_end|>\n" for m in messages]
        return "".join(turns) + "<|im_start|>assistant\n"

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        return list(self.render(messages).encode())

    def encode_text(self, prompt: str) -> list[int]:
        return list(prompt.encode())


class HFTokenizer:
    """A model folder's own tokenizer and chat template (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {folder} does not exist")
        self._tok: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        if not self._tok.chat_template:
            raise ValueError(f"tokenizer in {folder} has no chat template")

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        from jinja2 import TemplateError

        conversation = [m.template_dict() for m in messages]
        try:
            ids = self._tok.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except TemplateError as exc:
            raise InvalidRequest(
                f"The messages do not fit the model's chat template: {exc}", param="messages"
            ) from None
        return [int(i) for i in ids]

    def encode_text(self, prompt: str) -> list[int]:
        return [int(i) for i in self._tok.encode(prompt, add_special_tokens=True)]


def tokenizer_for(pool: PoolConfig, store: ModelStore) -> PromptTokenizer:
    """The pool's tokenizer: bytes, or the model's own files (from `s3://`, only the tokenizer files)."""
    source = pool.tokenizer_source
    if source == "bytes":
        return ByteTokenizer()
    try:
        folder = store.resolve(source, only=TOKENIZER_FILES if source.startswith("s3://") else None)
    except ModelSourceError as exc:
        raise ValueError(f"pool {pool.name}: tokenizer not available: {exc}") from None
    return HFTokenizer(folder)
