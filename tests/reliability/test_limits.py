"""The default size limits follow the machine's memory (onnxgrad.model.limits), and the environment
variables override them down to a single byte or subgraph."""

from __future__ import annotations

import os

import pytest

from onnxgrad.errors import InputError
from onnxgrad.model import limits
from onnxgrad.model.limits import DEFAULT_MAX_SUBGRAPHS, DEFAULT_MAX_TENSOR_BYTES, Limits, default_limits

GiB = 1 << 30


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    for name in ("ONNXGRAD_MAX_TENSOR_BYTES", "ONNXGRAD_MAX_TOTAL_BYTES", "ONNXGRAD_MAX_SUBGRAPHS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux tells the memory in /proc/meminfo")
def test_physical_memory_is_the_machines():
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    memory = limits.physical_memory()
    assert memory is not None and abs(memory - total_kib * 1024) <= 0.1 * total_kib * 1024


def test_physical_memory_is_none_where_the_os_does_not_say(monkeypatch):
    def refuse(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", refuse)
    assert limits.physical_memory() is None


@pytest.mark.parametrize(
    ("memory", "tensor", "total"),
    [
        (8 * GiB, 8 * GiB, 8 * GiB),  # a small machine: one tensor at most all of it
        (64 * GiB, DEFAULT_MAX_TENSOR_BYTES, 64 * GiB),
        (None, DEFAULT_MAX_TENSOR_BYTES, DEFAULT_MAX_TENSOR_BYTES),  # the OS does not say
    ],
)
def test_default_limits_follow_the_machines_memory(monkeypatch, memory, tensor, total):
    monkeypatch.setattr(limits, "physical_memory", lambda: memory)
    assert default_limits() == Limits(max_tensor_bytes=tensor, max_total_bytes=total, max_subgraphs=1024)
    assert DEFAULT_MAX_SUBGRAPHS == 1024


def test_environment_variables_go_down_to_one(monkeypatch):
    monkeypatch.setenv("ONNXGRAD_MAX_TENSOR_BYTES", "1")
    monkeypatch.setenv("ONNXGRAD_MAX_TOTAL_BYTES", "2")
    monkeypatch.setenv("ONNXGRAD_MAX_SUBGRAPHS", "1")
    assert default_limits() == Limits(max_tensor_bytes=1, max_total_bytes=2, max_subgraphs=1)
    monkeypatch.setenv("ONNXGRAD_MAX_SUBGRAPHS", "many")
    with pytest.raises(InputError, match=r"ONNXGRAD_MAX_SUBGRAPHS='many' is not a number of subgraphs"):
        default_limits()
    monkeypatch.setenv("ONNXGRAD_MAX_SUBGRAPHS", "")
    assert default_limits().max_subgraphs == DEFAULT_MAX_SUBGRAPHS  # empty: unset
