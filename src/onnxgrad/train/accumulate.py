"""Gradient accumulation: the gradients of several mini-batches summed into the gradient of their
mean loss, as one batch of their concatenation would give.

Each batch's gradient is weighted by its number of samples, and :meth:`Accumulated.mean` divides by
the samples actually accumulated. So an update made on fewer batches than asked (the batches left at
the end of an epoch) is the gradient of the mean loss over those samples, not a gradient shrunk by
``batches / accumulate`` as the ``loss / accumulate`` recipe of torch loops gives.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["Accumulated"]


class Accumulated:
    """The gradients of the batches of one update: the batch's own for one batch, else their sum
    weighted by batch size (divided by the number of samples when the update is made)."""

    def __init__(self) -> None:
        self.grads: dict[str, np.ndarray] = {}
        self.samples, self.batches, self.loss = 0, 0, 0.0

    @classmethod
    def add(
        cls, pending: Accumulated | None, grads: Mapping[str, np.ndarray], loss: float, n: int
    ) -> Accumulated:
        """``pending`` (a new one when ``None``) with one more batch of ``n`` samples."""
        pending = pending if pending is not None else cls()
        if pending.batches == 0:
            pending.grads = dict(grads)
        else:
            if pending.batches == 1:  # weigh the first batch now that there are several
                pending.grads = {k: g * pending.samples for k, g in pending.grads.items()}
            for k, g in grads.items():
                pending.grads[k] += g * n
        pending.samples, pending.batches = pending.samples + n, pending.batches + 1
        pending.loss += loss * n
        return pending

    def mean(self) -> dict[str, np.ndarray]:
        """The gradient of the mean loss over the samples of the batches."""
        if self.batches > 1:
            for g in self.grads.values():
                g /= self.samples
        return self.grads
