"""Resampling ops, one module per idea: Resize and Upsample (:mod:`.resize`, with the node's
attributes read by :mod:`.resize_mode` and the run-time taps of :mod:`.resize_run_time`),
GridSample and AffineGrid (:mod:`.grid`), Col2Im (:mod:`.col2im`). Importing the package
registers their rules."""

from . import col2im, grid, resize, resize_run_time  # noqa: F401
