"""Parameters in and out of Flower's records: an ``ArrayRecord`` keyed by parameter name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["ARRAYS_KEY", "METRICS_KEY", "array_record", "arrays_of", "reply_record"]

ARRAYS_KEY = "arrays"  # the keys Flower's strategies read and write (FedAvg's arrayrecord_key)
METRICS_KEY = "metrics"


def array_record(values: Mapping[str, np.ndarray]) -> Any:
    """``values`` as a ``flwr.app.ArrayRecord`` (name -> ``Array``)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({name: Array(np.ascontiguousarray(v)) for name, v in values.items()})


def arrays_of(content: Any) -> dict[str, np.ndarray]:
    """The arrays of a message's ``RecordDict``: its ``ArrayRecord`` (the strategy's key, or its only
    one), name -> numpy array."""
    records = content.array_records
    record = records.get(ARRAYS_KEY) if ARRAYS_KEY in records else next(iter(records.values()), None)
    if record is None:
        return {}
    return {name: array.numpy() for name, array in record.items()}


def reply_record(values: Mapping[str, np.ndarray] | None, metrics: Mapping[str, float | int]) -> Any:
    """A reply's ``RecordDict``: the arrays (none for an evaluate reply) and the metrics."""
    from flwr.app import MetricRecord, RecordDict

    content: dict[str, Any] = {METRICS_KEY: MetricRecord(dict(metrics))}  # type: ignore[arg-type]
    if values is not None:
        content = {ARRAYS_KEY: array_record(values), **content}
    return RecordDict(content)
