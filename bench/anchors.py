"""The three anchor models of shared/reference/anchors.md, built in PyTorch and exported to ONNX.

Used by the benchmark (``bench/compare_torch.py``) and by the cross-checks against PyTorch autograd
(``tests/test_anchors.py``), so both measure exactly the same networks.
"""

from __future__ import annotations

import io
import math

import onnx
import torch
from torch import nn

# Input shapes of the benchmark, as the anchors page fixes them.
INPUT_SHAPES = {
    "mlp": (256, 784),
    "cnn": (64, 1, 28, 28),
    "transformer": (16, 128, 256),
}


class Attention(nn.Module):
    """Multi-head self-attention written with MatMul and Softmax (no fused kernels)."""

    def __init__(self, d_model: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d_head = heads, d_model // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(b, t, self.heads, self.d_head).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d_head))
        attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, d)
        return self.o(out)


class EncoderLayer(nn.Module):
    """One post-norm transformer encoder layer: d_model 256, 4 heads, FFN 1024 with ReLU."""

    def __init__(self, d_model: int = 256, heads: int = 4, ffn: int = 1024) -> None:
        super().__init__()
        self.attn = Attention(d_model, heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ff1, self.ff2 = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.ff2(torch.relu(self.ff1(x))))


def build(name: str, seed: int = 0) -> nn.Module:
    """The torch module of anchor ``name`` ("mlp", "cnn" or "transformer"), seeded."""
    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(400, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, 10),
        )
    if name == "transformer":
        return EncoderLayer()
    raise ValueError(f"unknown anchor model {name!r}")


def export(module: nn.Module, example: torch.Tensor, opset: int = 17) -> onnx.ModelProto:
    """``torch.onnx.export`` (TorchScript exporter, weights as initializers, dynamic batch)."""
    buf = io.BytesIO()
    torch.onnx.export(
        module,
        (example,),
        buf,
        opset_version=opset,
        dynamo=False,
        input_names=["input"],
        output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
    )
    model = onnx.load_from_string(buf.getvalue())
    model.ir_version = min(model.ir_version, 10)
    return model


def example_input(
    name: str,
    batch: int | None = None,
    dtype: torch.dtype = torch.float32,
    seq: int | None = None,
    seed: int = 1,
) -> torch.Tensor:
    """A random input of the anchor's shape (optionally a smaller batch / sequence)."""
    shape = list(INPUT_SHAPES[name])
    if batch is not None:
        shape[0] = batch
    if seq is not None and name == "transformer":
        shape[1] = seq
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype)
