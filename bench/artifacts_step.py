"""Time one training step: the one-graph step (onnxgrad.artifacts.Runner) against the two-session
step with numpy AdamW (ForwardBackward + onnxgrad.train.AdamW, what Trainer runs).

    python bench/artifacts_step.py [--sizes 784 512 512 10] [--batch 256] [--threads 2] [--steps 30]

Prints the median milliseconds of each (after a few warm-up steps), interleaved run by run so
that a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import onnxruntime as ort

from onnxgrad import ForwardBackward
from onnxgrad.artifacts import Runner, generate
from onnxgrad.demo import build_mlp
from onnxgrad.train import AdamW, add_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[784, 512, 512, 10])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    model = build_mlp(tuple(args.sizes), rng)
    batch = {
        "pixels": rng.random((args.batch, args.sizes[0]), dtype=np.float32),
        "target": rng.integers(0, args.sizes[-1], args.batch),
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")

    fb = ForwardBackward(add_loss(model, "cross_entropy"), outputs=["loss"], session_options=options)
    opt = AdamW(fb.parameters, lr=1e-3)
    seed = {"loss": np.ones((), np.float32)}

    def two_sessions() -> None:
        opt.step(fb.forward(batch).backward(seed))

    with tempfile.TemporaryDirectory() as tmp:
        generate(model, loss="cross_entropy", optimizer="adamw", out_dir=tmp)
        runner = Runner(tmp, threads=args.threads)

        def one_graph() -> None:
            runner.step(batch)

        times: dict[str, list[float]] = {"one graph (Runner)": [], "two sessions + numpy AdamW": []}
        fns = dict(zip(times, (one_graph, two_sessions)))
        for _ in range(3):
            for fn in fns.values():
                fn()
        for _ in range(args.steps):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e3)
    sizes = "-".join(map(str, args.sizes))
    print(f"MLP {sizes}, batch {args.batch}, {args.threads} threads, {args.steps} steps")
    for name, ts in times.items():
        print(f"  {name:30s} median {statistics.median(ts):7.2f} ms   (min {min(ts):.2f})")


if __name__ == "__main__":
    main()
