"""Gradient rules by op family; importing this package registers all of them."""

from . import (  # noqa: F401
    attention,
    control_flow,
    conv,
    elementwise,
    indexing,
    linalg,
    losses,
    misc,
    ml,
    nn,
    nondiff,
    norm,
    reduce,
    resample,
    rnn,
    sequence,
    shape,
    spectral,
)
