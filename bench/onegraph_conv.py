"""The vgg one-graph step (artifacts ``Runner``) with and without its Convs on the blocked kernels.

Interleaved in one process, so a loaded machine slows every contender alike: two runners of the
same artifacts folder made with :func:`~onnxgrad.runtime.blocked_conv.blocked_convs` turned off
("before": the generic im2col Conv, as when ``make_session`` passed a file through untouched),
two with it ("after"), the second of each pair an A/A control, and the two-session path and torch
eager of ``bench/compare_torch.py`` for scale. Each round runs one step of each; printed: median
and fastest step, and the per-round ratios after/before and A/A.

    PYTHONPATH=src:. python bench/onegraph_conv.py [--rounds 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import bench.compare_torch as bench
import onnxgrad.runtime.runner as runner_module
from onnxgrad.artifacts import Runner


def _paired(num: list[float], den: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(num, den))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=bench.THREADS)
    args = parser.parse_args(argv)
    bench.THREADS = args.threads
    torch.set_num_threads(args.threads)
    keep: list = []
    fns = bench.setup_full("vgg", keep)  # writes the artifacts folder; its runner is "after"
    folder = keep[0].name
    module, x = bench._model("vgg")
    with torch.no_grad():
        target = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(2))
    batch = {"input": x.numpy(), "target": target.numpy()}
    blocked = runner_module.blocked_convs
    runner_module.blocked_convs = lambda model, providers, shapes_from=None: model
    try:
        before = [Runner(folder, session_options=bench._options()) for _ in range(2)]
    finally:
        runner_module.blocked_convs = blocked
    after2 = Runner(folder, session_options=bench._options())
    contenders: dict[str, Callable[[], object]] = {
        "one graph, before (generic Conv)": lambda: before[0].step(batch),
        "one graph, after (blocked Conv)": fns["onnxgrad one graph"],
        "one graph, before #2 (A/A)": lambda: before[1].step(batch),
        "one graph, after #2 (A/A)": lambda: after2.step(batch),
        "onnxgrad 2 sessions+np": fns["onnxgrad 2 sessions+np"],
        "torch eager AdamW": fns["torch eager AdamW"],
    }
    for fn in contenders.values():  # warm-up
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:34s} median {statistics.median(t) * 1e3:7.1f} ms  fastest {min(t) * 1e3:7.1f} ms")
    b, a, b2, a2 = (times[k] for k in list(contenders)[:4])
    print(f"after/before by round, median: {_paired(a, b):.3f} and {_paired(a2, b2):.3f}")
    print(f"A/A by round, median: after {_paired(a2, a):.3f}, before {_paired(b2, b):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
