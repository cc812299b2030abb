"""Training-step time of onnxgrad against PyTorch eager on the anchor models.

One step = forward + backward with an output gradient of ones, gradients of every weight. In one
process, the contenders are interleaved (blocks of a few steps each, in turn) and the median is
reported:
onnxgrad's numpy path (``ForwardBackward``), ``OnnxModule`` under torch autograd, and PyTorch eager.
Peak memory is measured per contender in a fresh subprocess (resident set growth during steps).

The full training step (forward, MSE loss, backward and the AdamW update) is measured the same
way (``--full-step``, on by default): onnxgrad's one-graph step (``onnxgrad.artifacts.Runner``,
what ``Trainer`` runs), the two-session step with numpy AdamW (``ForwardBackward`` +
``onnxgrad.train.AdamW``, ``Trainer``'s fallback) and PyTorch eager with
``torch.optim.AdamW(foreach=True)``.

The time to build the gradient graphs of a 24-layer stack of the transformer layer is measured too.

Each model is timed in a fresh process of its own (``--in-process``: all in this one); the
figures carry the machine they were taken on (CPU, cores, vector extensions, load average,
versions). Medians and fastest steps are both printed: on a shared machine the fastest step is the
steadier of the two.

    python bench/compare_torch.py [--models mlp cnn transformer tiny vgg] [--steps 30] [--threads 2]
                                  [--json out.json]

``--threads N`` sets both torch's and onnxruntime's intra-op threads (default 2, the project
machine's cores). It runs with any torch: where the installed one is outside onnxgrad's supported
range, ``onnxgrad.torch`` does not import, the ``OnnxModule`` row is left out and the reason printed
(the numpy path, the one-graph step and torch eager are still timed).
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
from collections.abc import Callable

import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import onnxgrad
from bench import anchors
from onnxgrad.deps import DependencyError
from onnxgrad.runtime.runner import default_options

THREADS = 2
"""intra-op threads of torch and onnxruntime (``--threads``)."""


def onnx_module_class() -> tuple[type | None, str | None]:
    """``OnnxModule``, or ``None`` and why where the installed torch is outside onnxgrad's range."""
    try:
        from onnxgrad.torch import OnnxModule
    except DependencyError as exc:
        return None, str(exc)
    return OnnxModule, None


def machine() -> dict:
    """The machine and versions the figures were taken on (CPU model, cores, vector extensions,
    load average), as ``docs/performance.md`` reports them."""
    import platform

    import numpy as np
    import onnxruntime as ort

    cpu, flags = platform.processor() or "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(
            line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")
        )
        flags = next(line.split(":", 1)[1] for line in info.splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    vector = sorted({f for f in flags.split() if f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")})
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "vector": " ".join(vector),
        "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "onnxgrad": onnxgrad.__version__,
    }


def _tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 16), torch.randn(4, 16)


def _vgg() -> tuple[torch.nn.Module, torch.Tensor]:
    """A VGG-style CNN of 3x3 convolutions on 32x32 RGB images, batch 32 (not an anchor: the
    convolutions most vision models are made of)."""
    from torch import nn

    torch.manual_seed(0)

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        convs = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1)]
        return [*convs, nn.ReLU(), nn.MaxPool2d(2)]

    module = nn.Sequential(*block(3, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 8 * 8, 10))
    return module, torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(1))


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, torch.Tensor]]] = {"tiny": _tiny, "vgg": _vgg}


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The torch module and example batch of ``name``: an anchor, or one of :data:`MODELS`."""
    if name in MODELS:
        return MODELS[name]()
    return anchors.build(name), anchors.example_input(name)


def setup(name: str, only: str | None = None) -> dict[str, Callable[[], None]]:
    """The step function of each contender for model ``name`` (or of contender ``only``)."""
    module, x = _model(name)
    model = anchors.export(module, x[:1])
    opts = _options()  # no spinning pool threads (they would also steal torch's cores)
    with torch.no_grad():  # a training step's saved activations must not hide under this peak
        ones = torch.ones_like(module(x))
    fns: dict[str, Callable[[], None]] = {}

    if only in (None, "onnxgrad numpy"):
        fb = onnxgrad.ForwardBackward(model, session_options=opts)
        feeds = {"input": x.numpy()}
        fns["onnxgrad numpy"] = lambda: fb.forward(feeds).backward() and None

    onnx_module, _ = onnx_module_class()
    if only in (None, "onnxgrad OnnxModule") and onnx_module is not None:
        om = onnx_module(model, session_options=opts)

        def module_step() -> None:
            om.zero_grad(set_to_none=True)
            om(x).backward(ones)

        fns["onnxgrad OnnxModule"] = module_step

    if only in (None, "torch eager"):

        def torch_step() -> None:
            module.zero_grad(set_to_none=True)
            module(x).backward(ones)

        fns["torch eager"] = torch_step
    return fns


def _options() -> ort.SessionOptions:
    """onnxgrad's default session options at :data:`THREADS` intra-op threads."""
    opts = default_options()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    return opts


FULL_LR, FULL_WD = 1e-3, 1e-2


def setup_full(name: str, keep: list | None = None) -> dict[str, Callable[[], None]]:
    """The full-step function (forward, MSE loss, backward, AdamW update) of each contender for
    model ``name``. ``keep`` receives objects that must outlive the functions (temporary folders)."""
    import numpy as np

    from onnxgrad.artifacts import Runner, generate
    from onnxgrad.train import AdamW, add_loss

    module, x = _model(name)
    model = anchors.export(module, x[:1])
    with torch.no_grad():
        target = torch.randn(module(x).shape, generator=torch.Generator().manual_seed(2))
    opts = _options()
    batch = {"input": x.numpy(), "target": target.numpy()}
    fns: dict[str, Callable[[], None]] = {}

    folder = tempfile.TemporaryDirectory()
    if keep is not None:
        keep.append(folder)
    generate(model, loss="mse", loss_options={"output": "output"}, optimizer="adamw", lr=FULL_LR,
             optimizer_options={"weight_decay": FULL_WD}, out_dir=folder.name)  # fmt: skip
    runner = Runner(folder.name, session_options=opts)
    fns["onnxgrad one graph"] = lambda: runner.step(batch) and None

    fb = onnxgrad.ForwardBackward(
        add_loss(model, "mse", output="output"), outputs=["loss"], session_options=opts
    )
    opt = AdamW(fb.parameters, lr=FULL_LR, weight_decay=FULL_WD)
    seed = {"loss": np.ones((), np.float32)}
    fns["onnxgrad 2 sessions+np"] = lambda: opt.step(fb.forward(batch).backward(seed))

    torch_opt = torch.optim.AdamW(module.parameters(), lr=FULL_LR, weight_decay=FULL_WD, foreach=True)

    def torch_step() -> None:
        torch_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(module(x), target).backward()
        torch_opt.step()

    fns["torch eager AdamW"] = torch_step
    return fns


# Steps of each contender per block, and how many of them open the block uncounted (see time_steps).
BLOCK, SKIP = 8, 3


def time_steps(
    name: str, steps: int, warmup: int = 3, block: int = BLOCK, full: bool = False
) -> dict[str, float]:
    """Median milliseconds per step of each contender, interleaved by blocks of ``block`` steps.

    The first :data:`SKIP` steps of each block are not counted: a training loop runs its steps
    back to back, and what the figures compare is that steady state. Right after the other
    contender's block, the other runtime's threads are still busy (torch's OpenMP threads
    busy-wait after a parallel region) and the caches hold its data: on the 2-vCPU AMD EPYC the
    onnxgrad step right after torch's took, by position in its block, cnn 7.6, 5.7, 5.4, 5.3, 5.2 ms
    and mlp 7.7, 5.4, 4.9, 4.8, 4.8 ms (torch's own after onnxgrad's: mlp 5.6, 5.1, 5.0, 5.0, 4.9),
    so counting from the second step charged one contender for the other's idle threads.
    ``full``: the full step (:func:`setup_full`) instead of forward + backward.
    """
    return {k: statistics.median(v) for k, v in step_times(name, steps, warmup, block, full).items()}


def step_times(
    name: str, steps: int, warmup: int = 3, block: int = BLOCK, full: bool = False
) -> dict[str, list[float]]:
    """The milliseconds of every counted step of each contender (see :func:`time_steps`)."""
    keep: list = []
    fns = setup_full(name, keep) if full else setup(name)
    return interleave(fns, steps, warmup, block, skip=min(SKIP, block - 1))


def interleave(
    fns: dict[str, Callable[[], object]], calls: int, warmup: int = 3, block: int = 5, skip: int = 1
) -> dict[str, list[float]]:
    """The milliseconds of at least ``calls`` counted calls of each function, run in turn by
    blocks of ``block`` calls after ``warmup`` calls each; the first ``skip`` calls of a block are
    not counted (see :func:`time_steps`)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    while min(len(v) for v in times.values()) < calls:
        for k, fn in fns.items():
            for i in range(block):
                t0 = time.perf_counter()
                fn()
                if i >= skip:
                    times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def peak_memory(name: str, contender: str, steps: int = 5) -> float:
    """Peak resident-set growth (MiB) over ``steps`` steps of one contender alone in a fresh
    process, above what the process held after building the model (weights, sessions)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import resource, sys, torch; sys.path.insert(0, {root!r}); torch.set_num_threads({THREADS});"
        f"import bench.compare_torch as bench; bench.THREADS = {THREADS};"
        f"fn = bench.setup({name!r}, {contender!r})[{contender!r}];"
        "import os; page = os.sysconf('SC_PAGE_SIZE');"
        "base = int(open('/proc/self/statm').read().split()[1]) * page / 1024;"  # resident KiB now
        f"[fn() for _ in range({steps})];"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def build_seconds(layers: int, repeats: int = 3) -> float:
    """Median seconds of ``build_gradient`` on a stack of ``layers`` anchor transformer layers."""
    torch.manual_seed(0)
    stack = torch.nn.Sequential(*[anchors.EncoderLayer() for _ in range(layers)])
    model = anchors.export(stack, anchors.example_input("transformer", batch=1))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        onnxgrad.build_gradient(model)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_model(name: str, args: argparse.Namespace) -> dict:
    """Every figure of one model: forward + backward and full step (median and fastest step of
    each contender, ratios to torch's) and peak memory."""
    out: dict = {"step": {}, "full_step": {}}
    times = step_times(name, args.steps)
    ref_med, ref_min = statistics.median(times["torch eager"]), min(times["torch eager"])
    for k, v in times.items():
        med, low = statistics.median(v), min(v)
        mem = float("nan") if args.no_memory else peak_memory(name, k)
        out["step"][k] = {
            "ms": med,
            "ratio": med / ref_med,
            "min_ms": low,
            "min_ratio": low / ref_min,
            "peak_mib": mem,
        }
    if args.full_steps:
        times = step_times(name, args.full_steps, full=True)
        ref_med, ref_min = statistics.median(times["torch eager AdamW"]), min(times["torch eager AdamW"])
        for k, v in times.items():
            med, low = statistics.median(v), min(v)
            out["full_step"][k] = {
                "ms": med,
                "ratio": med / ref_med,
                "min_ms": low,
                "min_ratio": low / ref_min,
            }
    return out


def _isolated(name: str, args: argparse.Namespace) -> dict:
    """:func:`run_model` in a fresh process (one process per comparison: no model's allocations,
    thread pools or caches carry over to the next)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "figures.json")
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--models",
            name,
            "--steps",
            str(args.steps),
            "--full-steps",
            str(args.full_steps),
            "--build-layers",
            "0",
            "--threads",
            str(THREADS),
            "--in-process",
            "--json",
            path,
        ]
        if args.no_memory:
            cmd.append("--no-memory")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            return json.load(f)["models"][name]


def main(argv: list[str] | None = None) -> int:
    global THREADS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "mlp", "cnn", "transformer", "vgg"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--threads", type=int, default=THREADS, help="intra-op threads of torch and onnxruntime (default 2)"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory runs")
    parser.add_argument(
        "--full-steps", type=int, default=20, help="steps of the full-step comparison (0: skip it)"
    )
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument(
        "--build-layers", type=int, default=24, help="transformer layers of the build-time run (0: skip)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="time every model in this process (default: one process each)",
    )
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    THREADS = args.threads
    torch.set_num_threads(THREADS)
    figures: dict = {"machine": machine(), "threads": THREADS, "steps": args.steps, "models": {}}
    _, skipped = onnx_module_class()
    figures["onnx_module_skipped"] = skipped
    print(", ".join(f"{k}: {v}" for k, v in figures["machine"].items()) + f", threads: {THREADS}")
    if skipped:
        print(f"onnxgrad OnnxModule not timed: {skipped}")
    for name in args.models:
        figures["models"][name] = run_model(name, args) if args.in_process else _isolated(name, args)
    cols = ("median ms", "vs torch", "min ms", "vs torch", "peak MiB")
    for part, title in (("step", "forward+backward"), ("full_step", "full step (AdamW)")):
        if part == "full_step" and not args.full_steps:
            continue
        header = f"{'model':12s} {title:22s} " + " ".join(
            f"{c:>9s}" for c in cols[: 5 if part == "step" else 4]
        )
        print(f"\n{header}\n" + "-" * len(header))
        for name, res in figures["models"].items():
            for k, v in res[part].items():
                row = f"{name:12s} {k:22s} {v['ms']:9.3f} {v['ratio']:9.2f}"
                row += f" {v['min_ms']:9.3f} {v['min_ratio']:9.2f}"
                print(row + (f" {v['peak_mib']:9.1f}" if part == "step" else ""))
    build = None
    if args.build_layers:
        build = build_seconds(args.build_layers)
        print(f"\ngradient graphs of a {args.build_layers}-layer transformer built in {build:.2f} s")
    figures["build_seconds"] = {"layers": args.build_layers, "seconds": build}
    figures["full_step_optimizer"] = "AdamW"
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
