"""The session-option policy of large training states (onnxgrad.runtime.options.options_for_state)."""

from __future__ import annotations

import onnxruntime as ort

from onnxgrad.runtime import options as policy


def test_large_state_runs_without_the_cpu_arena_and_keeps_the_callers_options():
    limit = policy.NO_ARENA_BYTES
    assert policy.options_for_state(None, limit - 1) is None  # small: session_options_for decides
    given = ort.SessionOptions()
    given.intra_op_num_threads = 3
    assert policy.options_for_state(given, limit - 1) is given

    large = policy.options_for_state(given, limit)
    assert large is not given and large.enable_cpu_mem_arena is False
    assert large.intra_op_num_threads == 3  # a copy of the caller's settings
    assert given.enable_cpu_mem_arena is True  # the caller's options stay as they are

    default = policy.options_for_state(None, limit)
    assert default.enable_cpu_mem_arena is False
    assert default.get_session_config_entry("session.intra_op.allow_spinning") == "0"  # default_options
