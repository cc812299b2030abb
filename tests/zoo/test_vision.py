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
