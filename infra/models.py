"""Small models built on this machine, for tests and the dev stack (no model hub needed)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def training_text() -> list[str]:
    """Local text to train on: the source of a few standard-library modules (always present, stable)."""
    import argparse
    import difflib
    import json as json_module

    return [inspect.getsource(m) for m in (json_module, difflib, argparse)]


def build_tiny_tokenizer(dest: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer with a ChatML chat template, saved as a model folder's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    marker = dest / "tokenizer.json"
    if marker.exists():
        return dest
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )
    dest.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(dest))
    (dest / "sluice-model.json").write_text(json.dumps({"kind": "tiny-tokenizer", "vocab_size": vocab_size}))
    return dest
