"""OnnxModule behaves as torch users expect of a layer: state_dict keys are the exported model's,
inputs by name, another float type (autocast) cast at the border, a dtype conversion refused when
asked rather than at the next forward."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")

from onnxgrad.errors import InputError, InputTypeError  # noqa: E402
from onnxgrad.torch import OnnxModule  # noqa: E402
from onnxgrad.torch.module import torch_paths  # noqa: E402
from tests.torch.conftest import export_net  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.drop = torch.nn.Dropout(p)
        self.fc2 = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


def test_state_dict_keys_are_the_torch_model_keys(net):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    assert list(m.state_dict()) == list(net.state_dict())
    assert [n for n, _ in m.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert m.fc1.weight.shape == (8, 4)  # a submodule per path, as in the torch model
    # the torch model's state dict loads as it is, and the module computes the torch model
    torch.manual_seed(1)
    other = Net()
    m.load_state_dict(other.state_dict())
    x = torch.randn(5, 4)
    torch.testing.assert_close(m(x), other(x), rtol=1e-5, atol=1e-6)
    # and survives a pickle round trip with its paths
    clone = pickle.loads(pickle.dumps(m))
    torch.testing.assert_close(clone(x), other(x), rtol=1e-5, atol=1e-6)


def test_names_written_before_module_paths_still_load_and_read_with_a_warning(net):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    old = {k.replace(".", "_"): v + 1 for k, v in net.state_dict().items()}  # "fc1_weight"...
    m.load_state_dict(old)
    torch.testing.assert_close(m.fc1.weight, net.fc1.weight + 1)
    with pytest.warns(DeprecationWarning, match=r"OnnxModule.fc1_weight is now 'fc1.weight'"):
        assert m.fc1_weight is m.fc1.weight
    new = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.warns(DeprecationWarning):
        m.fc1_weight = new  # set where forward reads it, never beside it
    assert m.fc1.weight is new and "fc1_weight" not in dict(m.named_parameters())


def test_names_that_are_no_module_path_stay_attribute_names():
    paths = torch_paths(["fc.weight", "fc", "onnx::MatMul_12", "0.bias", "layer.forward", "tied", "_x.w"])
    assert paths == {
        "fc.weight": "fc.weight",
        "fc": "fc_2",  # "fc" is the submodule of "fc.weight": this one cannot be both
        "onnx::MatMul_12": "onnx__MatMul_12",
        "0.bias": "0.bias",
        "layer.forward": "layer_forward",  # nn.Module's own attribute
        "tied": "tied_2",  # OnnxModule's own attribute
        "_x.w": "_x_w",
    }


def test_inputs_by_keyword(net):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    x = torch.randn(3, 4)
    torch.testing.assert_close(m(x=x), m(x))
    with pytest.raises(InputError, match=r"input\(s\) \['x'\] given both by position and by name"):
        m(x, x=x)
    with pytest.raises(InputError, match=r"unknown input name\(s\) \['y'\]"):
        m(y=x)


def test_autocast_activations_are_cast_at_the_border_and_the_gradient_comes_back_in_their_type(net):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    x = torch.randn(6, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.linear(x, torch.eye(4))  # bfloat16 under autocast
        assert h.dtype == torch.bfloat16
        h.retain_grad()
        y = m(h)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16
    # what torch computes in float32 from the same bfloat16 activation
    ref = net(h.detach().float().requires_grad_())
    torch.testing.assert_close(y.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for p in m.parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
    x64 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    m(x64).sum().backward()
    assert x64.grad.dtype == torch.float64


@pytest.mark.parametrize("convert", ["double", "half", "bfloat16", "to_float64"])
def test_a_dtype_conversion_is_refused_when_asked(net, convert):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    with pytest.raises(
        InputTypeError, match=r"converting its float32 parameters to (float64|float16|bfloat16)"
    ):
        m.to(torch.float64) if convert == "to_float64" else getattr(m, convert)()
    assert all(p.dtype == torch.float32 for p in m.parameters())  # nothing half converted
    m.to("cpu")  # no conversion: accepted
    m.float()
    assert m(torch.randn(2, 4)).dtype == torch.float32


def test_dropout_masks_follow_onnxruntime_seed_not_torch_seed():
    """Documented in docs/torch_layer.md: the masks are onnxruntime's, seeded by
    ``onnxruntime.set_seed`` before the module's sessions are made."""
    torch.manual_seed(0)
    net = Net(p=0.5)
    model = export_net(net.train(), torch.randn(2, 4))
    x = torch.randn(64, 4)

    def masked_output() -> np.ndarray:
        ort.set_seed(7)
        m = OnnxModule(model).train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return m(x).detach().numpy()

    first, second = masked_output(), masked_output()
    np.testing.assert_array_equal(first, second)


def test_a_weight_beside_its_adapters_keeps_both():
    """LoRA names an adapter after its weight ("w1.lora_A" beside "w1"): the weight takes an
    attribute name, the adapters a submodule, and no former name shadows that submodule."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnxgrad import lora

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    adapted = lora.add_adapters(model, ["w1"], rank=2)
    m = OnnxModule(adapted)
    assert sorted(m.onnx_names[n] for n, _ in m.named_parameters()) == sorted(lora.adapter_names(adapted))
    assert isinstance(m.w1, torch.nn.Module)  # the adapters' submodule
    onnx.checker.check_model(m.to_onnx())


def test_a_value_of_another_type_assigned_is_refused_at_the_forward(net):
    m = OnnxModule(export_net(net, torch.randn(2, 4)))
    m.load_state_dict({k: v.double() for k, v in net.state_dict().items()}, assign=True)
    with pytest.raises(
        InputTypeError, match=r"'fc1.weight' holds float64 values, the model computes in float32"
    ):
        m(torch.randn(2, 4))
    m.load_state_dict(net.state_dict(), assign=True)  # its type again: runs
    torch.testing.assert_close(m(torch.ones(2, 4)), net(torch.ones(2, 4)), rtol=1e-5, atol=1e-6)


def test_integer_inputs_that_do_not_fit_the_model_type_are_refused():
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["y"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT32, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.arange(20, dtype=np.float32).reshape(10, 2), "E")],
    )
    m = OnnxModule(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9))
    torch.testing.assert_close(m(torch.tensor([1, 9])), torch.tensor([[2.0, 3.0], [18.0, 19.0]]))
    with pytest.raises(InputError, match=r"input 'ids' holds 4294967297, outside the range of int32"):
        m(torch.tensor([2**32 + 1]))
    with pytest.raises(InputError, match=r"input 'ids' holds 3000000000.0, outside the range of int32"):
        m(torch.tensor([3e9]))
    del onnx


def test_a_batchnorm_state_dict_loads_strictly():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)).eval()
    m = OnnxModule(export_net(net, torch.randn(3, 4)))
    m.load_state_dict(net.state_dict())  # its num_batches_tracked has no ONNX value: left out
    x = torch.randn(5, 4)
    torch.testing.assert_close(m.eval()(x), net(x), rtol=1e-5, atol=1e-6)
