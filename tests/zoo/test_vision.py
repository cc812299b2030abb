"""Zoo, vision and speech models from transformers (see _util): gradients, 20 SGD steps."""

from __future__ import annotations

import pytest

from tests.zoo._util import cases, check_gradients, check_training

pytest.importorskip("transformers")

MODELS = ["vit", "resnet", "convnext", "mobilenet_v2", "whisper_encoder"]


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "gradients"))
def test_gradients_match_torch(name, exporter):
    check_gradients(name, exporter)


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "onnxmodule"))
def test_onnxmodule_training_follows_torch(name, exporter):
    check_training(name, exporter, "onnxmodule")


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "forwardbackward"))
def test_forwardbackward_training_follows_torch(name, exporter):
    check_training(name, exporter, "forwardbackward")


def test_mobilenet_input_keeps_every_relu6_off_its_kinks():
    """The margin the MobileNetV2 gradient check relies on (see _mobilenet_v2): in float64 torch,
    every ReLU6 input of the example input is at least 1.5e-5 from 0 and from 6 (2.0e-5 today), past
    float32's ~1e-5 forward error, so no mask flips between float32 and float64. If the model, its
    perturbation or its input changes, this says so before the gradient check fails obscurely."""
    import copy

    import torch

    from tests.zoo._util import model_and_inputs

    module, inputs = model_and_inputs("mobilenet_v2")
    ref = copy.deepcopy(module).double()
    gaps = []

    def hook(_mod, args, _out):
        x = args[0].detach()
        gaps.append(float(torch.minimum(x.abs(), (x - 6).abs()).min()))

    relus = [m for m in ref.modules() if isinstance(m, torch.nn.ReLU6)]
    assert len(relus) >= 10
    for m in relus:
        m.register_forward_hook(hook)
    with torch.no_grad():
        ref(*[t.double() for t in inputs])
    assert len(gaps) >= len(relus)
    assert min(gaps) >= 1.5e-5, f"a ReLU6 input is {min(gaps):.1e} from a kink"
