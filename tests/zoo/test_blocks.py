"""Zoo, torch building blocks: gradients against torch autograd, 20 SGD steps (see _util)."""

from __future__ import annotations

import pytest

from tests.zoo._util import cases, check_gradients, check_training

MODELS = [
    "mha",
    "transformer_encoder_layer",
    "transformer_decoder_layer",
    "lstm",
    "gru",
    "embedding",
    "bn_convnet",
]


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "gradients"))
def test_gradients_match_torch(name, exporter):
    check_gradients(name, exporter)


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "onnxmodule"))
def test_onnxmodule_training_follows_torch(name, exporter):
    check_training(name, exporter, "onnxmodule")


@pytest.mark.parametrize(("name", "exporter"), cases(MODELS, "forwardbackward"))
def test_forwardbackward_training_follows_torch(name, exporter):
    check_training(name, exporter, "forwardbackward")
