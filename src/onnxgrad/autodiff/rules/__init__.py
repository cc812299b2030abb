"""Gradient rules, one module per op family; importing this package registers all of them.

``common`` holds what several families share; every other module registers the rules of its family
(``nondiff`` declares every op that stops the gradient). onnxruntime's ops (the ``com.microsoft``
domain, and ``SimplifiedLayerNormalization``) sit beside their ONNX twins, each registered with its
domain: the activations in ``elementwise``, FusedMatMul in ``linalg``, MatMulNBits in ``quant``,
the fused normalizations in ``norm``, the attention ops and RotaryEmbedding in ``attention``. Their
output types come from :mod:`onnxgrad.model.contrib_schemas` (ONNX shape inference knows none).
"""

from . import (  # noqa: F401
    attention,
    control_flow,
    conv,
    elementwise,
    indexing,
    linalg,
    losses,
    ml,
    nondiff,
    norm,
    pool,
    quant,
    reduce,
    resample,
    rnn,
    sequence,
    shape,
    softmax,
    spectral,
)
