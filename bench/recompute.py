"""Activation recomputation on the 24-layer transformer: peak memory and step time, with and without.

The model is the anchor transformer layer (d_model 256, 4 heads, FFN 1024) stacked ``--layers``
times, exported once. Each setting (``recompute=None``, ``"layers"``: one segment per layer, the
layer inputs kept; ``"all"``: everything rebuilt from the input) runs in two fresh subprocesses.
The first times ``--steps`` training steps (forward + backward, output gradient of ones) after a
warm-up, with onnxgrad's default session options. The second measures memory: onnxruntime's CPU
arena off and glibc's mmap threshold fixed, so that the resident set follows the tensors alive; after
a warm-up step it resets the process's peak resident set (``/proc/self/clear_refs``), runs the steps
and reports the peak (``VmHWM``) above the resident set before them, and the bytes of the
activations the forward hands to the backward (``GradientGraphs.saved``, at the batch size run).

    python bench/recompute.py [--layers 24] [--batch 4] [--steps 3] [--json out/recompute.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

THREADS = 2
SETTINGS = {"none": None, "layers": "layers", "all": "all"}


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def child(path: str, setting: str, batch: int, steps: int, memory: bool) -> dict:
    """One setting in this process (run by :func:`measure` in a fresh one): with ``memory``, the
    peak resident set (arena off), else the step time (onnxgrad's default session options)."""
    import numpy as np

    import onnxgrad
    from onnxgrad.runtime.runner import default_options

    opts = default_options()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    # no arena: freed tensors go back to the system, so the resident set follows what is alive
    opts.enable_cpu_mem_arena = not memory
    order = os.environ.get("ONNXGRAD_BENCH_ORDER")
    if order:
        import onnxruntime as ort

        opts.execution_order = getattr(ort.ExecutionOrder, order)
    fb = onnxgrad.ForwardBackward(path, recompute=SETTINGS[setting], session_options=opts)
    x = np.random.default_rng(0).normal(size=(batch, 128, 256)).astype(np.float32)
    res = fb.forward({"input": x})  # warm-up: sessions made, arenas sized
    res.backward()
    del res
    fed = set(fb.graphs.trainable) | {i.name for i in fb.graphs.forward.graph.input}
    activations = [n for n in fb.graphs.saved if n not in fed]
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current resident set
        f.write("5")
    base = _status("VmRSS")
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        res = fb.forward({"input": x})
        res.backward()
        times.append(time.perf_counter() - t0)
        del res
    peak = _status("VmHWM")
    saved_bytes = _saved_bytes(fb, x, activations)
    if not memory:
        return {"ms": statistics.median(times) * 1e3}
    return {
        "peak_mib": (peak - base) / 1024,
        "saved_values": len(activations),
        "saved_mib": saved_bytes / 2**20,
    }


def _saved_bytes(fb, x, names) -> int:
    """Bytes of the activations handed to the backward, from one forward of the forward graph."""
    import onnxruntime as ort

    sess = ort.InferenceSession(fb.graphs.forward.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"input": x, **{k: v for k, v in fb.parameters.items()}}
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in sess.get_inputs()}}
    outs = sess.run(names, feeds) if names else []
    return sum(o.nbytes for o in outs)


def measure(path: str, setting: str, batch: int, steps: int) -> dict:
    """Step time and peak memory of one setting, each in a fresh process."""
    result = {}
    for memory in (False, True):
        code = (
            f"import sys, json; sys.path.insert(0, {ROOT!r}); from bench.recompute import child;"
            f"print(json.dumps(child({path!r}, {setting!r}, {batch}, {steps}, {memory})))"
        )
        env = dict(os.environ)
        if memory:
            # a fixed mmap threshold: glibc returns every large freed block at once (its default
            # threshold rises after the first frees, and freed tensors would then stay resident)
            env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(out.stderr[-3000:])
        result.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return result


def export(layers: int, path: str) -> None:
    import onnx
    import torch

    from bench import anchors

    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[anchors.EncoderLayer() for _ in range(layers)])
    onnx.save(anchors.export(stack, anchors.example_input("transformer", batch=1)), path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "transformer.onnx")
        export(args.layers, path)
        header = (
            f"{'recompute':10s} {'ms/step':>9s} {'peak MiB':>9s} {'saved MiB':>10s} {'saved values':>13s}"
        )
        print(f"{args.layers}-layer transformer, batch {args.batch} x 128 x 256, {THREADS} threads")
        print(header)
        print("-" * len(header))
        for s in args.settings:
            r = results[s] = measure(path, s, args.batch, args.steps)
            print(
                f"{s:10s} {r['ms']:9.1f} {r['peak_mib']:9.1f} {r['saved_mib']:10.1f} {r['saved_values']:13d}"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {"layers": args.layers, "batch": args.batch, "threads": THREADS, "results": results},
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
