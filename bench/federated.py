"""Bytes and seconds per round of a federated run on Flower, full model against LoRA adapters.

A SuperLink and two SuperNodes on loopback (Flower's deployment engine, as in tests/federated), the
Flower App of tests/federated, an MLP (``--width`` hidden units, two hidden layers) trained for
``--rounds`` rounds of ``--steps`` local mini-batches: once with every parameter trainable, once with
rank-``--rank`` LoRA adapters on its weights (the base frozen, left on the nodes). Reads each run's
``history.json``: the bytes of the arrays sent to the nodes and received from them, and the seconds
of each round (the first round includes the apps' start).

    python bench/federated.py [--json out/federated.json]

docs/performance.md ("Federated rounds on Flower") reports a run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.federated.cluster import Cluster
from tests.models import make_model

from onnxgrad.lora import add_adapters
from onnxgrad.train.checkpoint import read_checkpoint


def mlp(width: int, n_in: int = 64, n_out: int = 10) -> onnx.ModelProto:
    """x -> Gemm -> Relu -> Gemm -> Relu -> Gemm, float32."""
    rng = np.random.default_rng(0)
    dims = [n_in, width, width, n_out]
    inits: dict[str, np.ndarray] = {}
    nodes = []
    x = "x"
    for i, (a, b) in enumerate(itertools.pairwise(dims), start=1):
        inits[f"W{i}"] = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        inits[f"b{i}"] = np.zeros(b, np.float32)
        out = "y" if i == len(dims) - 1 else f"h{i}"
        nodes.append(onnx.helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [out]))
        if out != "y":
            nodes.append(onnx.helper.make_node("Relu", [out], [f"r{i}"]))
            x = f"r{i}"
    return make_model(nodes, [("x", np.float32, ["N", n_in])], [("y", np.float32, ["N", n_out])], inits, 17)


def run(cluster: Cluster, root: Path, name: str, model: onnx.ModelProto, args: argparse.Namespace) -> dict:
    onnx.save(model, root / f"{name}.onnx")
    out = root / f"out_{name}"
    start = time.perf_counter()
    result = cluster.run(
        {
            "model": str(root / f"{name}.onnx"),
            "data": str(root / "data"),
            "out-dir": str(out),
            "num-server-rounds": args.rounds,
            "local-steps": args.steps,
            "batch-size": 32,
            "lr": 0.01,
        },
        timeout=900,
    )
    if result.returncode != 0:
        raise SystemExit(result.stdout + result.stderr + cluster.logs())
    history = json.loads((out / "history.json").read_text())
    trainable = sum(a.size for a in read_checkpoint(out / "checkpoint.npz")["params"].values())
    return {
        "name": name,
        "trainable_values": trainable,
        "bytes_sent_per_round": history[0]["bytes_sent"],
        "bytes_received_per_round": history[0]["bytes_received"],
        "seconds_per_round": [round(r["seconds"], 2) for r in history],
        "median_seconds_after_first": statistics.median(r["seconds"] for r in history[1:]),
        "run_seconds": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "data").mkdir()
        rng = np.random.default_rng(1)
        for i in range(2):
            np.savez(
                root / "data" / f"part{i}.npz",
                x=rng.normal(size=(256, 64)).astype(np.float32),
                target=rng.normal(size=(256, 10)).astype(np.float32),
            )
        base = mlp(args.width)
        cluster = Cluster(root / "flower", nodes=2)
        try:
            rows = [
                run(cluster, root, "full", base, args),
                run(cluster, root, "lora", add_adapters(base, ["W1", "W2", "W3"], rank=args.rank), args),
            ]
        finally:
            cluster.close()
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    )
    print(f"{args.rounds} rounds, 2 SuperNodes on loopback, {args.steps} local steps of 32; {machine}")
    print(
        "| model | trainable values | bytes sent / round | bytes received / round "
        "| s / round (median, after the first) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['trainable_values']:,} | {r['bytes_sent_per_round']:,} | "
            f"{r['bytes_received_per_round']:,} | {r['median_seconds_after_first']:.2f} |"
        )
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"machine": machine, "args": vars(args), "runs": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
