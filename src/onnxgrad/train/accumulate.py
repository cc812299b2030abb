"""Gradient accumulation: the gradients of several mini-batches combined into the gradient of the
loss of their concatenation, as one batch of it would give.

A batch's loss is a sum divided by a *normalizer*: the number of samples for a plain mean, the sum
of the sample weights for a weighted mean, the number of labels not ignored for a class loss, 1
for ``reduction="sum"`` (:meth:`onnxgrad.train.losses.LossSpec.normalizer`). The loss of the
concatenation is then ``Σ D_b L_b / Σ D_b``, and so is its gradient: each batch's gradient is
weighted by its normalizer and :meth:`Accumulated.mean` divides by the normalizers accumulated
(:meth:`Accumulated.total` for a sum, which divides by nothing). So an update made on fewer batches
than asked (the batches left at the end of an epoch) is the gradient of the loss over those samples,
not a gradient shrunk by ``batches / accumulate`` as the ``loss / accumulate`` recipe of torch loops
gives.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["Accumulated"]


class Accumulated:
    """The gradients of the batches of one update: the batch's own for one batch, else their sum
    weighted by each batch's normalizer (divided by the normalizers' sum when the update is made)."""

    def __init__(self) -> None:
        self.grads: dict[str, np.ndarray] = {}
        self.samples, self.batches, self.loss, self.weight = 0, 0, 0.0, 0.0

    @classmethod
    def add(
        cls,
        pending: Accumulated | None,
        grads: Mapping[str, np.ndarray],
        loss: float,
        n: int,
        weight: float | None = None,
    ) -> Accumulated:
        """``pending`` (a new one when ``None``) with one more batch of ``n`` samples, whose loss
        was divided by ``weight`` (its normalizer; default ``n``, a plain mean)."""
        pending = pending if pending is not None else cls()
        weight = float(n) if weight is None else float(weight)
        if pending.batches == 0:
            pending.grads = dict(grads)
        else:
            if pending.batches == 1:  # weigh the first batch now that there are several
                pending.grads = {k: g * pending.weight for k, g in pending.grads.items()}
            for k, g in grads.items():
                pending.grads[k] += g * weight
        pending.samples, pending.batches = pending.samples + n, pending.batches + 1
        pending.loss += loss * weight
        pending.weight += weight
        return pending

    def mean(self) -> dict[str, np.ndarray]:
        """The gradient of the loss of the batches' concatenation, for a loss that is a mean (a sum
        divided by the normalizer)."""
        if self.batches > 1:
            for g in self.grads.values():
                g /= self.weight
        return self.grads

    def total(self) -> dict[str, np.ndarray]:
        """The gradient of the loss of the batches' concatenation, for ``reduction="sum"``: the sum
        of the batches' gradients (accumulated with normalizer 1)."""
        return self.grads

    def concatenated_loss(self, summed: bool = False) -> float:
        """The loss of the concatenation: ``Σ D_b L_b / Σ D_b``, or ``Σ L_b`` when ``summed``."""
        if summed:
            return self.loss
        return self.loss / self.weight if self.weight else float("nan")
