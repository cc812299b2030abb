"""The adapted model and each node's token sequences.

The model is the run config's ``model`` (onnxruntime-genai's int4 file) with rank-4 LoRA adapters on
every MatMulNBits (the 4-bit weights stay frozen) and its logits transposed to (batch, vocabulary,
position), the layout ``cross_entropy`` reads. Node ``i`` (``partition-id``) holds next-token
examples of sequences that count by ``i + 1`` modulo the vocabulary: each node its own pattern.
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxgrad import lora
from onnxgrad.errors import GradientWarning

VOCAB, LAYERS, KV_HEADS, HEAD = 128, 2, 2, 16


@functools.cache
def adapted(path: str) -> onnx.ModelProto:
    """The model of ``path`` with adapters and (batch, vocabulary, position) scores as ``class_scores``."""
    with warnings.catch_warnings():  # accuracy_level=4: the gradient is the float product's (docs)
        warnings.simplefilter("ignore", GradientWarning)
        model = lora.add_adapters(onnx.load(os.path.abspath(path)), "*", rank=4, alpha=8)
    g = model.graph
    g.node.append(helper.make_node("Transpose", ["logits"], ["class_scores"], perm=[0, 2, 1]))
    g.output.append(
        helper.make_tensor_value_info("class_scores", TensorProto.FLOAT, ["batch", VOCAB, "positions"])
    )
    return model


def sequences(partition_id: int, n: int = 32, length: int = 8) -> dict[str, np.ndarray]:
    """``n`` next-token examples of ``length`` tokens counting by ``partition_id + 1``, no past."""
    rng = np.random.default_rng(partition_id)
    ids = (rng.integers(0, VOCAB, (n, 1)) + (partition_id + 1) * np.arange(length + 1)) % VOCAB
    data = {"input_ids": ids[:, :-1], "attention_mask": np.ones((n, length), np.int64), "target": ids[:, 1:]}
    for layer in range(LAYERS):
        for kind in ("key", "value"):
            data[f"past_key_values.{layer}.{kind}"] = np.zeros((n, KV_HEADS, 0, HEAD), np.float32)
    return data
