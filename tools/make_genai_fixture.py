"""Regenerate the tiny Llama that onnxruntime-genai's model builder writes (tests/lora/test_genai_builder.py).

onnxruntime-genai is not a dependency of onnxgrad; this script runs in a separate virtual environment
that has it (0.15.2 is the newest whose builder imports with transformers < 5)::

    python3.11 -m venv /tmp/genai-venv
    /tmp/genai-venv/bin/pip install onnxruntime-genai==0.15.2 "transformers<5" torch==2.13.0 \\
        onnx onnx_ir safetensors
    /tmp/genai-venv/bin/python tools/make_genai_fixture.py

It writes, under ``tests/data/``:

* ``genai_llama_hf/``: ``config.json`` and ``model.safetensors`` of a random LlamaForCausalLM
  (hidden 64, MLP 96, 2 layers, 4 query heads, 2 key/value heads, vocabulary 128, 64 positions; weights
  drawn from a seeded generator), which the tests load into transformers to compare with torch;
* ``genai_llama_fp32/model.onnx`` and ``genai_llama_int4/model.onnx``: what
  ``python -m onnxruntime_genai.models.builder -i genai_llama_hf -o ... -p fp32|int4 -e cpu`` writes
  for it (the builder's other files, genai_config.json and the tokenizer's, are not kept).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
HF = DATA / "genai_llama_hf"

CONFIG = {
    "hidden_size": 64,
    # not the vocabulary size: the builder takes any Linear with vocab_size outputs for the LM head
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def write_hf_model() -> None:
    """A random LlamaForCausalLM, seeded, saved with transformers' save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    with torch.no_grad():  # norms away from 1, so that their gradients are not those of a unit scale
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if HF.exists():
        shutil.rmtree(HF)
    model.save_pretrained(HF, safe_serialization=True)
    for extra in HF.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            extra.unlink()


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer of the model's 128 ids: the builder writes the tokenizer's files beside
    the model and refuses a folder without one (the tests feed ids, they use none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0")
    fast.save_pretrained(folder)


def build(precision: str) -> None:
    """Run the builder on ``genai_llama_hf`` and keep its model.onnx (one file: the model is tiny)."""
    out = DATA / f"genai_llama_{precision}"
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "hf"
        shutil.copytree(HF, source)
        write_tokenizer(source)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(source), "-o", tmp]
        cmd += ["-p", precision, "-e", "cpu", "-c", str(Path(tmp) / "cache")]
        subprocess.run(cmd, check=True)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir()
        shutil.copy(Path(tmp) / "model.onnx", out / "model.onnx")
        data = Path(tmp) / "model.onnx.data"
        if data.exists():
            shutil.copy(data, out / "model.onnx.data")


def main() -> None:
    write_hf_model()
    for precision in ("fp32", "int4"):
        build(precision)


if __name__ == "__main__":
    main()
