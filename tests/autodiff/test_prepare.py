"""autodiff.prepare: the checked model, its training and inference variants, made on first use."""

from __future__ import annotations

from onnxgrad.autodiff import modes
from onnxgrad.autodiff.prepare import prepare
from onnxgrad.model import CheckedModel

from ..models import mlp
from ..test_layers import _batchnorm_model


def test_the_variants_are_made_on_first_use_and_once(monkeypatch):
    calls = []
    original = modes.set_training_mode

    def counted(model, training):
        calls.append(training)
        return original(model, training)

    monkeypatch.setattr("onnxgrad.autodiff.prepare.set_training_mode", counted)
    prepared = prepare(_batchnorm_model())
    assert prepared.follows_training and calls == []
    assert prepared.buffers == ["mean", "var"]
    assert prepared.training is not prepared.checked and calls == [True]
    eval_graphs = prepared.eval_graphs(prepared.gradient_graphs())
    assert calls == [True, False]  # the inference twin of the training copy
    assert set(eval_graphs.outputs) >= {"y"} and eval_graphs.trainable == ["W", "scale", "bias"]
    assert prepare(prepared) is prepared


def test_a_model_without_modes_is_its_own_variants():
    prepared = prepare(mlp())
    assert not prepared.follows_training and prepared.running_stats == {}
    assert prepared.training is prepared.checked is prepared.inference
    graphs = prepared.gradient_graphs()
    assert prepared.eval_graphs(graphs) is graphs
    as_given = prepare(_batchnorm_model(), modes=False)
    assert not as_given.follows_training and isinstance(as_given.training, CheckedModel)
