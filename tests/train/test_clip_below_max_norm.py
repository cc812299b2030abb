"""ClipGradNorm / ``clip_grad=`` leave gradients whose global norm is below ``max_norm`` as they
are (the factor is ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_``):
the optimizer models of the compat blocks give exactly the unclipped update."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxgrad.compat.training import onnxblock as ob
from tests.train.test_optimizers import SHAPES, _params


def _gradients(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [0.1 * rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]


def _norm(grads: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads)))


def test_clip_grad_norm_block_leaves_a_small_sequence_unscaled():
    grads = _gradients(0)
    assert _norm(grads) < 1.0  # below max_norm: nothing to clip
    with ob.empty_base() as accessor:
        accessor.model.graph.input.append(
            helper.make_tensor_sequence_value_info("gradients", TensorProto.FLOAT, None)
        )
        clipped = ob.optim.ClipGradNorm(1.0)("gradients")
        accessor.model.graph.output.append(
            helper.make_tensor_sequence_value_info(clipped, TensorProto.FLOAT, None)
        )
    session = ort.InferenceSession(accessor.model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"gradients": grads})
    for a, b in zip(got, grads):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", ["SGD", "AdamW"])
def test_optimizer_blocks_with_clip_grad_above_the_norm_update_as_without(kind):
    protos, values = _params()
    grads = _gradients(1)
    assert _norm(grads) < 10.0
    results = []
    for clip in (None, ob.optim.ClipGradNorm(10.0)):
        block = getattr(ob.optim, kind)(clip_grad=clip)
        with ob.empty_base() as accessor:
            block((protos, []))
        session = ort.InferenceSession(accessor.model.SerializeToString(), providers=["CPUExecutionProvider"])
        params = [values[k] for k in SHAPES]
        feeds = {"learning_rate": np.array([0.1], np.float32), "params": params, "gradients": grads}
        if kind == "AdamW":
            zeros = [np.zeros_like(p) for p in params]
            feeds.update(step=np.array([1], np.int64), first_order_moments=zeros, second_order_moments=zeros)
        results.append(session.run(None, feeds)[1:])
    for unclipped, clipped in zip(*results):
        for a, b in zip(unclipped, clipped):
            np.testing.assert_array_equal(a, b)
