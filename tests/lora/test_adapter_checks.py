"""What adapter files and targets keep and refuse: weights trained beside the adapters saved and put
back, names that match nothing, settings checked against the arrays, TorchScript names."""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad import lora
from onnxgrad.errors import GradientWarning, InputError

from .quantized_models import quantized
from .test_lora import _mlp, _run

torch = pytest.importorskip("torch")


def _trained_with_head(steps: int = 5) -> tuple[onnx.ModelProto, onnxgrad.ForwardBackward]:
    """Adapters beside w1 trained together with the head (w2, b2), as trainable= allows."""
    adapted = lora.add_adapters(_mlp(), ["w1"], rank=2)
    fb = onnxgrad.ForwardBackward(adapted, trainable=[*lora.adapter_names(adapted), "w2", "b2"])
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    for _ in range(steps):
        res = fb.forward({"x": x})
        grads = res.backward([(res.outputs[0] - 1.0) / res.outputs[0].size])
        fb.set_parameters({k: v - 0.01 * grads[k] for k, v in fb.parameters.items()})
    assert all(np.isfinite(v).all() for v in fb.parameters.values())
    return adapted, fb


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_weights_trained_beside_the_adapters_are_saved_and_loaded(tmp_path, suffix: str) -> None:
    adapted, fb = _trained_with_head()
    path = tmp_path / f"a{suffix}"
    lora.save_adapters(adapted, path, fb.parameters)
    meta, arrays = lora.read_adapters(path)
    assert meta["trained"] == ["b2", "w2"]
    np.testing.assert_array_equal(arrays["w2"], fb.parameters["w2"])
    again = lora.load_adapters(_mlp(), path)
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(again, x), _run(fb.to_onnx(), x))


def test_trainer_parameters_with_a_head_round_trip(tmp_path) -> None:
    from onnxgrad.train import Trainer

    adapted = lora.add_adapters(_mlp(), ["w1", "w2"], rank=2)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    trainer = Trainer(
        adapted,
        loss="mse",
        lr=1e-2,
        progress=False,
        batch_size=4,
        trainable=[*lora.adapter_names(adapted), "b2"],
    )
    trainer.fit({"x": x, "target": x[:, :3].copy()}, epochs=2)
    lora.save_adapters(adapted, tmp_path / "t.safetensors", trainer.parameters)
    again = lora.load_adapters(_mlp(), tmp_path / "t.safetensors")
    np.testing.assert_allclose(_run(again, x[:4]), _run(trainer.to_onnx(), x[:4]), rtol=0, atol=0)


def test_save_refuses_names_the_model_lacks_and_ort_adapter_refuses_to_lose_a_head(tmp_path) -> None:
    adapted, fb = _trained_with_head()
    with pytest.raises(InputError, match=r"\['nope'\].*not initializers"):
        lora.save_adapters(adapted, tmp_path / "x.npz", {**fb.parameters, "nope": np.zeros(1)})
    with pytest.raises(InputError, match=r"\['b2', 'w2'\].*would be lost"):
        lora.save_ort_adapter(adapted, tmp_path / "x.onnx_adapter", fb.parameters)
    served = lora.with_values(adapted, fb.parameters)  # the head in the model: nothing is lost
    lora.save_ort_adapter(served, tmp_path / "x.onnx_adapter", fb.parameters)
    assert sorted(lora.read_ort_adapter(tmp_path / "x.onnx_adapter")) == sorted(lora.adapter_names(adapted))


def test_onnx_module_to_onnx_names_the_head_it_trained(tmp_path) -> None:
    """OnnxModule.to_onnx rewrites the adapted model's trainable list to what trained (the
    adapters and the head), so that save_adapters keeps the head and the loaded model serves the same."""
    from onnxgrad.torch import OnnxModule

    adapted = lora.add_adapters(_mlp(), ["w1"], rank=2)
    module = OnnxModule(adapted, trainable=[*lora.adapter_names(adapted), "w2", "b2"])
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32))
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        (module(x) ** 2).mean().backward()
        opt.step()
    trained = module.to_onnx()
    assert sorted(onnxgrad.autodiff.params.declared_trainable(trained)) == sorted(
        [*lora.adapter_names(adapted), "w2", "b2"]
    )
    lora.save_adapters(trained, tmp_path / "m.safetensors")
    again = lora.load_adapters(_mlp(), tmp_path / "m.safetensors")
    np.testing.assert_array_equal(_run(again, x.numpy()), _run(trained, x.numpy()))
    with pytest.raises(InputError, match=r"\['b2', 'w2'\]; an onnxruntime adapter file overrides only"):
        lora.save_ort_adapter(trained, tmp_path / "m.onnx_adapter")


def test_values_may_be_torch_tensors_that_require_grad(tmp_path) -> None:
    """An OnnxModule's parameters (requiring grad) given as values= are detached: the same file
    and model as their NumPy copies; something that is no array is an InputError."""
    from onnxgrad.torch import OnnxModule

    adapted = lora.add_adapters(_mlp(), ["w1"], rank=2)
    module = OnnxModule(adapted, trainable=[*lora.adapter_names(adapted), "b2"])
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)
    tensors = {module.onnx_names[n]: p for n, p in module.named_parameters()}
    assert all(t.requires_grad for t in tensors.values())
    arrays = {n: t.detach().numpy() for n, t in tensors.items()}
    lora.save_adapters(adapted, tmp_path / "t.safetensors", tensors)
    lora.save_adapters(adapted, tmp_path / "a.safetensors", arrays)
    assert (tmp_path / "t.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_array_equal(_run(lora.with_values(adapted, tensors), x), _run(module.to_onnx(), x))
    served = lora.with_values(adapted, tensors)
    lora.save_ort_adapter(
        served, tmp_path / "t.onnx_adapter", {n: tensors[n] for n in lora.adapter_names(adapted)}
    )
    with pytest.raises(InputError, match=r"values\['w1.lora_A'\] is no array of numbers \(dict\)"):
        lora.save_adapters(adapted, tmp_path / "x.safetensors", {"w1.lora_A": {"a": 1}})


def test_adapters_whose_weight_the_base_lacks_are_refused(tmp_path) -> None:
    adapted = lora.add_adapters(_mlp(), ["w1", "w2"], rank=2)
    lora.save_adapters(adapted, tmp_path / "a.safetensors")
    renamed = _mlp()
    for t in renamed.graph.initializer:
        if t.name == "w2":
            t.name = "w2_renamed"
    for n in renamed.graph.node:
        n.input[:] = ["w2_renamed" if i == "w2" else i for i in n.input]
    with pytest.raises(InputError, match=r"no weight \['w2'\]"):
        lora.load_adapters(renamed, tmp_path / "a.safetensors")
    with pytest.raises(InputError, match=r"targets \['missing'\] match no weight.*w1, w2"):
        lora.add_adapters(_mlp(), ["missing", "w2"], rank=2)
    with pytest.raises(InputError, match=r"targets \['w9\*'\] match no weight"):
        lora.add_adapters(_mlp(), ["w1", "w9*"], rank=2)


def _rewrite_header(path, tmp_path, change) -> str:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"][lora.LORA_KEY])
    change(meta)
    header["__metadata__"][lora.LORA_KEY] = json.dumps(meta)
    raw = json.dumps(header).encode()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return bad


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(rank=500000), "not of the rank 500000"),
        (lambda m: m.update(alpha=float("nan")), "alpha must be a finite number"),
        (lambda m: m.update(rank=-3), "rank must be an integer"),
        (lambda m: m.update(dropout=2), r"dropout must be a number in \[0, 1\)"),
        (lambda m: m.update(trained=["w2"]), "lacks the arrays of the trained weights"),
        (lambda m: m["adapters"][0].update(a="gone"), "lacks the adapter arrays"),
        (lambda m: m.pop("alpha"), r"bad LoRA settings: no \['alpha'\] key"),
        (lambda m: m["adapters"][1].update(a="w1.lora_A", b="w1.lora_B"), "read the same array 'w1.lora_A'"),
        (lambda m: m.update(trained=["w1.lora_A"]), r"\['w1.lora_A'\] are adapter arrays and trained"),
        (lambda m: m["adapters"][0].update(scale=float("nan")), "have scale nan, not alpha / rank = 1.0"),
        (lambda m: m["adapters"][0].update(scale=100), "have scale 100, not alpha / rank = 1.0"),
        (lambda m: m["adapters"][0].update(layout="garbage"), "have layout 'garbage', not one of"),
        (lambda m: m["adapters"][0].update(layout="right_t"), "the base reads that weight in layout 'right'"),
    ],
)
def test_adapter_settings_are_checked_against_the_arrays(tmp_path, change, message) -> None:
    """A small file whose settings claim a huge rank is refused before anything is allocated; a
    tampered one (arrays shared, settings missing or contradicting the base) is refused."""
    adapted = lora.add_adapters(_mlp(), ["w1", "w2"], rank=2)
    lora.save_adapters(adapted, tmp_path / "a.safetensors")
    bad = _rewrite_header(tmp_path / "a.safetensors", tmp_path, change)
    with pytest.raises(InputError, match=message):
        lora.load_adapters(_mlp(), bad)


def test_a_rank_above_the_weight_is_refused_or_skipped() -> None:
    """w1 is 6x8, w2 8x3: rank 4 fits w1 only; named, w2 is refused; a pattern skips it."""
    with pytest.raises(
        InputError, match=r"rank 4 is above the size of 'w2' \(\[8, 3\]\).*at most min\(in, out\) = 3"
    ):
        lora.add_adapters(_mlp(), ["w1", "w2"], rank=4)
    assert lora.adapter_names(lora.add_adapters(_mlp(), "w*", rank=4)) == ["w1.lora_A", "w1.lora_B"]
    with pytest.raises(InputError, match=r"\['w1', 'w2'\] are smaller than rank 100"):
        lora.add_adapters(_mlp(), "w*", rank=100)
    assert len(lora.adapter_names(lora.add_adapters(_mlp(), ["w1", "w2"], rank=3))) == 4


def test_add_adapters_settings() -> None:
    with pytest.raises(InputError, match="alpha must be a finite number"):
        lora.add_adapters(_mlp(), alpha=float("nan"))
    with pytest.raises(InputError, match="rank must be an integer"):
        lora.add_adapters(_mlp(), rank=2.5)
    with pytest.raises(InputError, match="dropout must be"):
        lora.add_adapters(_mlp(), dropout=1.0)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.enc(x))


def _torchscript(tmp_path) -> onnx.ModelProto:
    """TorchScript export of a 3-D input: Linear's weights become onnx::MatMul_N."""
    torch.manual_seed(0)
    path = tmp_path / "ts.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Net(), (torch.randn(2, 3, 8),), str(path), dynamo=False)
    return onnx.load(path)


def test_torchscript_weights_are_matched_and_named_by_module_path(tmp_path) -> None:
    model = _torchscript(tmp_path)
    assert any(t.name.startswith("onnx::MatMul") for t in model.graph.initializer)
    adapted = lora.add_adapters(model, ["enc.0.weight", "head.weight"], rank=2)
    assert lora.adapter_names(adapted) == [
        "enc.0.weight.lora_A",
        "enc.0.weight.lora_B",
        "head.weight.lora_A",
        "head.weight.lora_B",
    ]
    with pytest.raises(
        InputError, match=r"\['fc1.weight'\] match no weight.*onnx::MatMul_\d+ \(head.weight\)"
    ):
        lora.add_adapters(model, ["fc1.weight"])
    from onnxruntime.quantization import quantize_dynamic

    onnx.save(model, tmp_path / "f.onnx")
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx")
    q = lora.add_adapters(onnx.load(tmp_path / "q.onnx"), rank=2)
    assert lora.adapter_names(q) == lora.adapter_names(adapted)  # the torch names, not the converter's
    w = next(t.name for t in model.graph.initializer if t.name.startswith("onnx::MatMul"))
    assert len(lora.adapter_names(lora.add_adapters(onnx.load(tmp_path / "q.onnx"), [w]))) == 2


def test_a_gemm_weight_quantize_dynamic_transposed_is_matched_by_module_path(tmp_path) -> None:
    """A 2-D input exports Linear as Gemm (transB=1) under its torch name; quantize_dynamic
    transposes it first (enc.0.weight_Transposed_quantized): "enc.0.weight" matches it, its adapters
    take that name, and they train; the file does not load on the float model (other weights)."""
    from onnxruntime.quantization import quantize_dynamic

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(_Net(), (torch.randn(2, 8),), str(tmp_path / "f.onnx"), dynamo=False)
    quantize_dynamic(tmp_path / "f.onnx", tmp_path / "q.onnx")
    q = onnx.load(tmp_path / "q.onnx")
    # onnxruntime 1.32 transposes first (enc.0.weight_Transposed_quantized); 1.31 does not
    quantized = {"enc.0.weight_Transposed_quantized", "enc.0.weight_quantized"}
    assert quantized & {t.name for t in q.graph.initializer}
    adapted = lora.add_adapters(q, ["enc.0.weight", "head.weight"], rank=2)
    names = ["enc.0.weight.lora_A", "enc.0.weight.lora_B", "head.weight.lora_A", "head.weight.lora_B"]
    assert lora.adapter_names(adapted) == names
    assert lora.adapter_names(lora.add_adapters(q, "enc.*.weight", rank=2)) == names[:2]
    fb = onnxgrad.ForwardBackward(adapted)
    x = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)
    losses = []
    for _ in range(5):
        res = fb.forward({fb.input_names[0]: x})
        losses.append(float((res.outputs[0] ** 2).mean()))
        grads = res.backward([2 * res.outputs[0] / res.outputs[0].size])
        fb.set_parameters({k: v - 0.5 * grads[k] for k, v in fb.parameters.items()})
    assert losses[-1] < losses[0]
    lora.save_adapters(fb.to_onnx(), tmp_path / "q.safetensors")
    with pytest.raises(InputError, match=r"no weight \['enc.0.weight(_Transposed)?_quantized'"):
        lora.load_adapters(tmp_path / "f.onnx", tmp_path / "q.safetensors")


def _tied_head() -> onnx.ModelProto:
    """A tied embedding as dynamo exports it: the table 'lm_head.weight' [V, D] read by Gather,
    and its transposed copy folded into 'val_7' [D, V], read by the lm_head MatMul whose
    name_scopes give the torch name 'lm_head.weight' too."""
    r = np.random.default_rng(0)
    table = r.normal(size=(10, 6)).astype(np.float32)
    mm = onnx.helper.make_node("MatMul", ["h", "val_7"], ["logits"], name="node_linear")
    mm.metadata_props.add(key="pkg.torch.onnx.name_scopes", value="['', 'lm_head', 'linear']")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["lm_head.weight", "ids"], ["h"], name="node_embedding"), mm],
        "tied",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 3])],
        [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [2, 3, 10])],
        [
            onnx.numpy_helper.from_array(table, "lm_head.weight"),
            onnx.numpy_helper.from_array(table.T.copy(), "val_7"),
        ],
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


def test_a_tied_head_is_adapted_alike_by_its_exact_name_and_a_pattern() -> None:
    """The exact torch name also names the table read by Gather (no adapter there): the folded copy
    answers it, as it answers "*lm_head*"; a name that only the table answers is refused."""
    by_name = lora.add_adapters(_tied_head(), "lm_head.weight", rank=2)
    by_pattern = lora.add_adapters(_tied_head(), "*lm_head*", rank=2)
    assert (
        lora.adapter_names(by_name)
        == lora.adapter_names(by_pattern)
        == ["lm_head.weight.lora_A", "lm_head.weight.lora_B"]
    )
    assert by_name.SerializeToString() == by_pattern.SerializeToString()
    model = _tied_head()
    model.graph.node[1].ClearField("metadata_props")  # the copy no longer answers the torch name
    with pytest.raises(InputError, match=r"cannot put an adapter beside 'lm_head.weight': read by Gather"):
        lora.add_adapters(model, "lm_head.weight", rank=2)


def test_low_precision_warning_once_per_call(tmp_path) -> None:
    q = quantized("int4_nbits", tmp_path)
    for node in q.graph.node:
        if node.op_type == "MatMulNBits":
            node.attribute.append(onnx.helper.make_attribute("accuracy_level", 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora.add_adapters(q, rank=2)
    low = [w for w in caught if issubclass(w.category, GradientWarning)]
    assert len(low) == 1, [str(w.message) for w in low]
    names = [n.name for n in q.graph.node if n.op_type == "MatMulNBits"]
    assert all(f"{n!r} (accuracy_level=4)" in str(low[0].message) for n in names)


def test_a_quantized_model_with_nothing_float_to_train_points_to_trainable_and_adapters(tmp_path) -> None:
    with pytest.raises(InputError, match=r"nothing to differentiate.*trainable=.*lora\.add_adapters"):
        onnxgrad.ForwardBackward(quantized("int8_static", tmp_path))


def test_a_trained_model_names_what_trained_and_save_adapters_keeps_it(tmp_path) -> None:
    """The documented flow, save_adapters(fb.to_onnx()), with a head trained beside the adapters:
    to_onnx names what trained in onnxgrad.trainable, save_adapters keeps the head."""
    from onnxgrad.train import Trainer

    adapted, fb = _trained_with_head()
    trained = fb.to_onnx()
    lora.save_adapters(trained, tmp_path / "a.safetensors")
    assert lora.read_adapters(tmp_path / "a.safetensors")[0]["trained"] == ["b2", "w2"]
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    np.testing.assert_array_equal(
        _run(lora.load_adapters(_mlp(), tmp_path / "a.safetensors"), x), _run(trained, x)
    )
    trainer = Trainer(
        adapted,
        loss="mse",
        lr=1e-3,
        progress=False,
        batch_size=4,
        trainable=[*lora.adapter_names(adapted), "b2"],
    )
    trainer.fit({"x": x, "target": x[:, :3].copy()}, epochs=1)
    lora.save_adapters(trainer.to_onnx(), tmp_path / "t.npz")
    assert lora.read_adapters(tmp_path / "t.npz")[0]["trained"] == ["b2"]
