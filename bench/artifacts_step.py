"""Time one training step: the one-graph step (onnxgrad.artifacts.Runner) against the two-session
step with numpy AdamW (ForwardBackward + onnxgrad.train.AdamW, what Trainer runs).

    python bench/artifacts_step.py [--sizes 784 512 512 10] [--batch 256] [--threads 2] [--steps 30]
                                   [--cnn] [--node]

Prints the median milliseconds of each (after a few warm-up steps), interleaved run by run so
that a busy machine slows both alike. ``--cnn``: the digits CNN of ``onnxgrad.demo.build_cnn`` on
``1 x 16 x 16`` images instead of the MLP. ``--node``: also the same folder and batch stepped by
the JavaScript runner (js/, onnxruntime-node, ``bench/node_step.mjs``), timed alternately with the
Python runner in rounds of ``--steps`` steps (two processes cannot interleave step by step).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
import onnxruntime as ort

from onnxgrad import ForwardBackward
from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.demo import build_cnn, build_mlp
from onnxgrad.train import AdamW, add_loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[784, 512, 512, 10])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cnn", action="store_true", help="the digits CNN (1 x 16 x 16 images)")
    ap.add_argument("--node", action="store_true", help="also time the Node runner (js/)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    if args.cnn:
        model = build_cnn(rng, side=16)
        batch = {
            "pixels": rng.random((args.batch, 1, 16, 16), dtype=np.float32),
            "target": rng.integers(0, 10, args.batch),
        }
    else:
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
        node = _node_times(tmp, batch, args) if args.node else None
        if node is not None:
            times["Node runner (onnxruntime-node)"], times["Python runner (same rounds)"] = node
    what = "CNN 1x16x16" if args.cnn else "MLP " + "-".join(map(str, args.sizes))
    print(f"{what}, batch {args.batch}, {args.threads} threads, {args.steps} steps")
    for name, ts in times.items():
        print(f"  {name:30s} median {statistics.median(ts):7.2f} ms   (min {min(ts):.2f})")


def _node_times(folder: str, batch: dict, args: argparse.Namespace, rounds: int = 3) -> tuple | None:
    """Per-step milliseconds of the Node runner and of the Python runner on ``folder``, alternating
    rounds of ``args.steps`` steps (a fresh Node process each round, warmed up by 3 steps)."""
    node = shutil.which("node")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if node is None or not os.path.isdir(os.path.join(root, "js", "node_modules", "onnxruntime-node")):
        print("no node or no js/node_modules (cd js && npm ci): Node runner not timed")
        return None
    batch_file = os.path.join(folder, "batch.safetensors")
    tensors.save(batch_file, {k: np.ascontiguousarray(v) for k, v in batch.items()})
    script = os.path.join(root, "bench", "node_step.mjs")
    runner = Runner(folder, threads=args.threads)
    for _ in range(3):
        runner.step(batch)
    node_ms: list[float] = []
    py_ms: list[float] = []
    for _ in range(rounds):
        cmd = [node, script, folder, batch_file, str(args.steps), str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        node_ms += result["times_ms"]
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.step(batch)
            py_ms.append((time.perf_counter() - start) * 1e3)
    return node_ms, py_ms


if __name__ == "__main__":
    main()
