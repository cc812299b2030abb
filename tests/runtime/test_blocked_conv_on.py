"""The blocked-Conv pass cannot turn itself off unnoticed (planted bug 5 of issue 39): where
onnxruntime writes NCHWc Convs on this CPU, the layout onnxgrad writes must agree with them, so the
pass is on; where it disagrees, one warning line says so. No skip: on a CPU without NCHWc kernels
both sides are 0."""

from __future__ import annotations

import logging

import pytest

from onnxgrad.runtime import blocked_conv
from onnxgrad.runtime.blocked_conv import block_size, native_block_size


def test_the_pass_is_on_wherever_onnxruntime_writes_nchwc_convs():
    assert native_block_size() in (0, 8, 16)
    assert block_size() == native_block_size(), (
        f"onnxruntime writes NCHWc Convs with blocks of {native_block_size()} on this CPU, but the blocked "
        "form onnxgrad writes disagrees with them (blocked_conv._agrees): the pass is off"
    )


@pytest.fixture
def fresh_probe():
    """block_size() probed again in the test, and again after it."""
    block_size.cache_clear()
    yield
    block_size.cache_clear()


def test_a_disagreeing_layout_turns_the_pass_off_with_one_warning(monkeypatch, caplog, fresh_probe):
    monkeypatch.setattr(blocked_conv, "native_block_size", lambda: 16)
    monkeypatch.setattr(blocked_conv, "_agrees", lambda block: False)
    with caplog.at_level(logging.WARNING, logger="onnxgrad.runtime.blocked_conv"):
        assert block_size() == 0
        assert block_size() == 0  # probed once per process
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "onnxruntime writes NCHWc Convs with blocks of 16 channels on this CPU, but the blocked form"
    )
    assert "run on the generic kernels" in record.getMessage()


def test_an_agreeing_layout_says_nothing(monkeypatch, caplog, fresh_probe):
    monkeypatch.setattr(blocked_conv, "native_block_size", lambda: 8)
    monkeypatch.setattr(blocked_conv, "_agrees", lambda block: block == 8)
    with caplog.at_level(logging.WARNING, logger="onnxgrad.runtime.blocked_conv"):
        assert block_size() == 8
    assert caplog.records == []
