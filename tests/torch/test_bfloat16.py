"""OnnxModule on a bfloat16 model: parameters are torch.bfloat16 tensors holding the model's bits,
the forward and the gradients follow torch's own bfloat16 computation, and to_onnx writes bfloat16
initializers back (numpy has no bfloat16: tensors cross as their bits)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnx import TensorProto, numpy_helper  # noqa: E402

from onnxgrad.errors import OnnxGradRuntimeError  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402
from tests.runtime.test_bfloat16 import N_IN, N_OUT, bfloat16_linear  # noqa: E402


def reference(x, w, b):
    """torch's computation of the model: float32 between the Casts."""
    return (x.float() @ w.float() + b.float()).bfloat16()


def assert_within_one_ulp(got, want):
    """Both are float32 results rounded to bfloat16; float32 sums in another order may round to the
    neighbouring bfloat16 (one ulp, at most 2^-7 of the value), never further."""
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=1e-6)


def test_module_follows_torch_in_bfloat16():
    model = bfloat16_linear()
    module = OnnxModule(model)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for name in ("W", "b"):
        p = module.get_parameter(name)
        assert isinstance(p, torch.nn.Parameter) and p.dtype == torch.bfloat16
        # the model's bits, unchanged
        np.testing.assert_array_equal(p.detach().view(torch.uint16).numpy(), inits[name].view(np.uint16))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, N_IN, generator=gen).bfloat16().requires_grad_()
    g = torch.randn(5, N_OUT, generator=gen).bfloat16()
    y = module(x)
    w = module.W.detach().clone().requires_grad_()
    b = module.b.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    want = reference(x_ref, w, b)
    assert_within_one_ulp(y, want)
    y.backward(g)
    want.backward(g)
    for got, ref in ((module.W.grad, w.grad), (module.b.grad, b.grad), (x.grad, x_ref.grad)):
        assert_within_one_ulp(got, ref)


def test_training_step_and_to_onnx_keep_bfloat16():
    module = OnnxModule(bfloat16_linear())
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    x = torch.randn(8, N_IN, generator=torch.Generator().manual_seed(1)).bfloat16()
    loss = module(x).float().square().mean()
    loss.backward()
    opt.step()
    assert module.W.dtype == torch.bfloat16
    proto = module.to_onnx()
    by_name = {t.name: t for t in proto.graph.initializer}
    assert by_name["W"].data_type == TensorProto.BFLOAT16
    np.testing.assert_array_equal(
        numpy_helper.to_array(by_name["W"]).view(np.uint16), module.W.detach().view(torch.uint16).numpy()
    )
    # the exported model holds the trained weights: a new module computes what this one does
    again = OnnxModule(proto)
    with torch.no_grad():
        torch.testing.assert_close(again(x), module(x), rtol=0, atol=0)
    # and a pickled module too
    restored = pickle.loads(pickle.dumps(module))
    with torch.no_grad():
        torch.testing.assert_close(restored(x), module(x), rtol=0, atol=0)


def test_master_weights_in_float32():
    """master_weights=True: float32 parameters, cast to bfloat16 at each forward (the model's type)."""
    plain, master = OnnxModule(bfloat16_linear()), OnnxModule(bfloat16_linear(), master_weights=True)
    assert master.W.dtype == torch.float32
    torch.testing.assert_close(master.W.detach().bfloat16(), plain.W.detach(), rtol=0, atol=0)
    x = torch.randn(3, N_IN, generator=torch.Generator().manual_seed(2)).bfloat16()
    y = master(x)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)
    y.float().sum().backward()
    assert master.W.grad.dtype == torch.float32
    assert master.to_onnx().graph.initializer[0].data_type == TensorProto.BFLOAT16


def test_bfloat16_kernels_onnxruntime_lacks_are_a_clear_error():
    """MatMul in bfloat16 has no kernel in onnxruntime's CPU provider: a clear error at the first
    call (the module itself builds), not a crash converting the weights."""
    module = OnnxModule(bfloat16_linear(cast=False))
    assert module.W.dtype == torch.bfloat16
    x = torch.randn(2, N_IN).bfloat16()
    try:
        y = module(x)
    except OnnxGradRuntimeError as exc:
        assert "onnxruntime cannot load" in str(exc) and "implementation" in str(exc)
    else:
        assert_within_one_ulp(y, reference(x, module.W.detach(), module.b.detach()))
        pytest.skip("this onnxruntime has bfloat16 MatMul on the CPU")
