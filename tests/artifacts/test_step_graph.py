"""The one-graph step as onnxruntime optimizes it: no copy the two-session step does not make."""

from __future__ import annotations

import collections

import onnx
import onnxruntime as ort
import torch
from bench import anchors

import onnxgrad
from onnxgrad.artifacts import generate
from onnxgrad.runtime.runner import default_options


def _optimized_ops(model: onnx.ModelProto, tmp_path, name: str) -> collections.Counter:
    """Op counts of ``model`` after onnxruntime's graph optimizations (as a session runs it)."""
    opts = default_options()
    opts.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
    ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return collections.Counter(n.op_type for n in onnx.load(opts.optimized_model_filepath).graph.node)


def test_attention_step_transposes_no_more_than_two_sessions(tmp_path):
    """The backward transposes the forward's transposed heads again; in one graph onnxruntime would
    compose the two permutations into a new copy instead of fusing the second into the MatMul."""
    torch.manual_seed(0)
    layer = anchors.EncoderLayer(d_model=32, heads=4, ffn=64)
    model = anchors.export(layer, torch.randn(1, 8, 32))
    fb = onnxgrad.ForwardBackward(model)
    two = _optimized_ops(fb.graphs.forward, tmp_path, "fwd") + _optimized_ops(
        fb.graphs.backward, tmp_path, "bwd"
    )
    art = generate(model, loss="mse", loss_options={"output": "output"}, optimizer="sgd")
    one = _optimized_ops(art.train_step, tmp_path, "step")
    assert two["Transpose"] > 0
    assert one["Transpose"] <= two["Transpose"]
    reshapes = [n for n in art.train_step.graph.node if n.op_type == "Reshape" and n.name.endswith("/alias")]
    assert len(reshapes) == 3  # K^T, Q and V transposed again by the backward
