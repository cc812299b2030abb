"""The standing net: the default trainable set of every zoo model against torch's own parameters
and buffers, both exporters, perturbed and freshly initialised (see _util and README.md).

Perturbed (every parameter element a distinct float32): an initializer is a parameter copy exactly
when :func:`match_initializers` maps all its elements to parameter elements; the default set must
be exactly those (no constant trained, no parameter frozen). Freshly initialised (zero biases, ones
LayerNorm weights: values cannot tell tensors apart): every name torch gives a parameter that the
file holds, as an initializer or an Identity alias of one, is a trainable initializer of its own,
every buffer's is frozen, and (dynamo, which folds nothing in these exports) no trainable
initializer named after nothing in torch holds one value repeated (a constant the exporter made:
masks, zero position biases, GroupNorm's ones). A freshly initialised table whose entries are all
equal (Swin's zeros) cannot be told from a constant once gathered: no check can see it. Perturbed,
each parameter element is also trained in one place only: copies of it (a gathered table's entries,
an expanded row) are tied, or they would drift apart.
"""

from __future__ import annotations

import numpy as np
import pytest

from onnxgrad.autodiff.params import select_parameters
from onnxgrad.model.graph import FLOAT_TYPES, to_array
from tests.zoo._util import EXPORTERS, SPECS, _as_trained, exported, match_initializers, model_and_inputs

CASES = [
    pytest.param(name, exporter, id=f"{name}-{exporter}")
    for name in SPECS
    for exporter in EXPORTERS
]  # fmt: skip


@pytest.mark.parametrize(("name", "exporter"), CASES)
def test_default_trainable_set_is_torchs(name, exporter):
    model = _as_trained(exported(name, exporter), name)
    module, _ = model_and_inputs(name)
    selection = select_parameters(model)
    decided = selection.decisions
    trained = {n for n, d in decided.items() if d.trainable}
    if SPECS[name].perturbed:
        match = match_initializers(model, module)
        copies = set(match.sources)
        frozen = sorted((n, decided[n].reason) for n in copies - trained)
        assert not frozen, f"parameter copies left out of the default set: {frozen}"
        floats = {i.name for i in selection.model.graph.initializer if i.data_type in FLOAT_TYPES}
        constants = sorted((n, decided[n].reason) for n in (trained & floats) - copies)
        assert not constants, f"initializers holding no parameter trained by default: {constants}"
        # and each parameter element trains in one place: copies that train apart drift apart
        # (tied copies are computed from their parameter; a rebuilt table is matched like the rest)
        held = match_initializers(selection.model, module).sources
        index = np.concatenate([held[n].ravel() for n in selection.trainable if n in held])
        index = index[index >= 0]
        twice = np.unique(index, return_counts=True)[1].max(initial=1)
        copies_apart = sorted(n for n in selection.trainable if n not in held)
        assert not copies_apart, f"trained tensors that hold no parameter: {copies_apart}"
        assert twice == 1, f"a parameter element trained in {twice} places apart"
        return
    params = {n for n, _ in module.named_parameters()}
    buffers = {n for n, _ in module.named_buffers()}
    inits = {i.name: i for i in selection.model.graph.initializer}
    held = set(inits) | {o for node in model.graph.node for o in node.output}
    missing = sorted(n for n in params & held if n not in trained)
    assert not missing, f"torch parameters the file holds, not trained apart: {missing}"
    wrong = sorted(n for n in buffers & set(inits) if n in trained)
    assert not wrong, f"torch buffers trained: {wrong}"
    if exporter != "dynamo":  # TorchScript's constant folding makes unnamed copies (a zero bias sliced)
        return
    made = []  # exported with optimize=False: nothing folded, an unnamed initializer is the exporter's
    for n in sorted(trained - params):
        flat = to_array(inits[n]).ravel()
        if inits[n].data_type in FLOAT_TYPES and flat.size > 1 and (flat == flat[0]).all():
            made.append((n, decided[n].reason))
    assert not made, f"constants the exporter made, trained by default: {made}"
