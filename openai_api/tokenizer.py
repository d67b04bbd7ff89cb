"""Prompt tokenization with each pool's own tokenizer, so the prompt token count is exact."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from openai_api.errors import InvalidRequest
from openai_api.openai_types import ChatMessage
from plumbing.model_store import TOKENIZER_FILES, ModelSourceError, ModelStore
from queue_schemas.config import PoolConfig

ToolDefinitions = Sequence[dict[str, Any]]


class PromptTokenizer(Protocol):
    def encode_chat(self, messages: Sequence[ChatMessage], tools: ToolDefinitions = ()) -> list[int]:
        """Render the pool's chat template with the generation prompt and return its token ids."""
        ...

    def encode_text(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt."""
        ...

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        ...


def conversation(
    messages: Sequence[ChatMessage], tools: ToolDefinitions, template_tools: bool, template_calls: bool
) -> list[dict[str, Any]]:
    """Messages as a chat template takes them. For a template that knows nothing of tools, the tool
    definitions become a system message and earlier tool calls become text, so the model still sees them."""
    turns = [m.template_dict() for m in messages]
    if not template_calls:
        for turn in turns:
            calls = turn.pop("tool_calls", None)
            if calls:
                text = "\n".join(
                    json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    for c in calls
                )
                turn["content"] = f"{turn['content']}\n{text}".strip()
    if tools and not template_tools:
        listing = json.dumps([t["function"] for t in tools])
        note = f'Functions you can call, by answering with JSON {{"name": ..., "arguments": ...}}: {listing}'
        turns.insert(0, {"role": "system", "content": note})
    return turns


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256) with a ChatML template: the simulated engine's tokenizer."""

    def render(self, messages: Sequence[ChatMessage], tools: ToolDefinitions = ()) -> str:
        turns = [
            f"<|im_start|>{t['role']}\n{t['content']}<|im_end|>\n"
            for t in conversation(messages, tools, False, False)
        ]
        return "".join(turns) + "<|im_start|>assistant\n"

    def encode_chat(self, messages: Sequence[ChatMessage], tools: ToolDefinitions = ()) -> list[int]:
        return list(self.render(messages, tools).encode())

    def encode_text(self, prompt: str) -> list[int]:
        return list(prompt.encode())

    @property
    def vocab_size(self) -> int:
        return 256


class HFTokenizer:
    """A model folder's own tokenizer and chat template (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        if not folder.is_dir():
            raise ValueError(f"tokenizer folder {folder} does not exist")
        self._tok: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        template = self._tok.chat_template
        if not template:
            raise ValueError(f"tokenizer in {folder} has no chat template")
        self.template_tools = "tools" in template
        self.template_calls = "tool_calls" in template

    def encode_chat(self, messages: Sequence[ChatMessage], tools: ToolDefinitions = ()) -> list[int]:
        from jinja2 import TemplateError

        turns = conversation(messages, tools, self.template_tools, self.template_calls)
        extra = {"tools": list(tools)} if tools and self.template_tools else {}
        try:
            ids = self._tok.apply_chat_template(
                turns, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
            )
        except TemplateError as exc:
            raise InvalidRequest(
                f"The messages do not fit the model's chat template: {exc}", param="messages"
            ) from None
        return [int(i) for i in ids]

    def encode_text(self, prompt: str) -> list[int]:
        return [int(i) for i in self._tok.encode(prompt, add_special_tokens=True)]

    @property
    def vocab_size(self) -> int:
        return len(self._tok)


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


INLINE_TOKENIZE_BYTES = 16 * 1024
T = TypeVar("T")


async def encode_off_loop(encode: Callable[[T], list[int]], what: T, body_bytes: int) -> list[int]:
    """Small prompts are tokenized inline; large ones in a thread, so the event loop keeps relaying."""
    if body_bytes <= INLINE_TOKENIZE_BYTES:
        return encode(what)
    return await asyncio.to_thread(encode, what)
