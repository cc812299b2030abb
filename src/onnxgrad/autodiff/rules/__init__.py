"""Gradient rules, one module per op family; importing this package registers all of them.

``common`` holds what several families share; every other module registers the rules of its family
(``nondiff`` declares every op that stops the gradient).
"""

from . import (  # noqa: F401
    attention,
    contrib,
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
