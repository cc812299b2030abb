"""A QLoRA training step on a 4-bit tiny Llama (onnxgrad on stock onnxruntime) against LoRA on the
float model in PyTorch eager: step time and peak memory.

The model: ``transformers.LlamaForCausalLM`` from a small config (random weights, never
downloaded), exported once with ``torch.onnx.export(dynamo=True)`` and quantized to 4 bits by
``MatMulNBitsQuantizer`` (blocks of 32, symmetric: every linear layer and the head become
``com.microsoft.MatMulNBits``). Contenders, each in a fresh subprocess, rank-8 adapters on every
linear layer and the head, base frozen, a step = forward, cross-entropy on the logits (numpy for
onnxgrad, torch for torch), backward, SGD update of the adapters:

* ``onnxgrad-4bit``: ``ForwardBackward`` on the 4-bit model with adapters (``lora.session_options``);
* ``onnxgrad-float``: the same on the float export;
* ``torch-float``: the float ``LlamaForCausalLM`` with LoRA wrappers on its ``nn.Linear`` layers.

Time: median and minimum of ``--steps`` steps after two warm-up steps, ``--threads`` threads each.
Memory: the peak resident set of the process (``VmHWM``) above its resident set once the libraries
are imported (before the model is loaded or built), in MiB; ``QLORA_BENCH_ARENA=0`` turns
onnxruntime's CPU arena off (freed tensors go back to the system: the peak follows what is alive).

    python bench/qlora_step.py [--hidden 256] [--layers 4] [--steps 10] [--workdir DIR] [--json F]
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
CONTENDERS = ("onnxgrad-4bit", "onnxgrad-float", "torch-float")
RANK = 8


def _status(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _config(hidden: int, layers: int) -> dict:
    return {
        "vocab_size": 1024,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 256,
    }


def export(path: str, hidden: int, layers: int, batch: int, seq: int) -> None:
    """The float and 4-bit ONNX models, ``path``-float.onnx and ``path``-4bit.onnx."""
    import onnx
    import torch
    import transformers
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_config(hidden, layers))).eval()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = torch.zeros((batch, seq), dtype=torch.int64)
    proto = torch.onnx.export(
        Logits().eval(), (ids,), dynamo=True, input_names=["ids"], output_names=["logits"]
    )
    proto = proto.model_proto
    onnx.save(proto, f"{path}-float.onnx")
    quantizer = MatMulNBitsQuantizer(proto, block_size=32, is_symmetric=True)
    quantizer.process()
    onnx.save(quantizer.model.model, f"{path}-4bit.onnx")


def child(
    contender: str, path: str, hidden: int, layers: int, batch: int, seq: int, steps: int, threads: int
) -> dict:
    """One contender in this process: step times (ms) and the peak resident set above the imports."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1024, size=(batch, seq + 1))
    x, y = ids[:, :-1], ids[:, 1:].reshape(-1)
    times = []
    if contender.startswith("onnxgrad"):
        import onnx

        from onnxgrad import ForwardBackward, lora

        base_rss = _status("VmRSS")
        model = onnx.load(f"{path}-{contender.split('-')[1]}.onnx")
        adapted = lora.add_adapters(model, "*", rank=RANK)
        del model
        options = lora.session_options()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.enable_cpu_mem_arena = os.environ.get("QLORA_BENCH_ARENA", "1") == "1"
        fb = ForwardBackward(adapted, session_options=options)
        del adapted
        for k in range(steps + 2):
            t0 = time.perf_counter()
            res = fb.forward({"ids": x})
            logits = res.outputs[0]
            flat = logits.reshape(-1, logits.shape[-1])
            p = np.exp(flat - flat.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            p[np.arange(len(y)), y] -= 1
            grads = res.backward([(p / len(y)).reshape(logits.shape).astype(np.float32)])
            fb.set_parameters({n: fb.parameters[n] - 1e-2 * g for n, g in grads.items()})
            if k >= 2:
                times.append(1e3 * (time.perf_counter() - t0))
        adapters = sum(v.size for v in fb.parameters.values())
    else:
        import torch
        import transformers

        torch.set_num_threads(threads)
        base_rss = _status("VmRSS")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_config(hidden, layers)))
        model.requires_grad_(False)

        class LoRA(torch.nn.Module):
            def __init__(self, linear: torch.nn.Linear) -> None:
                super().__init__()
                self.linear = linear
                self.a = torch.nn.Parameter(torch.randn(linear.in_features, RANK) / linear.in_features**0.5)
                self.b = torch.nn.Parameter(torch.zeros(RANK, linear.out_features))

            def forward(self, h):
                return self.linear(h) + (h @ self.a) @ self.b

        for module in list(model.modules()):
            for child_name, sub in list(module.named_children()):
                if isinstance(sub, torch.nn.Linear):
                    setattr(module, child_name, LoRA(sub))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-2)
        tx, ty = torch.from_numpy(x), torch.from_numpy(y)
        for k in range(steps + 2):
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = model(input_ids=tx, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ty)
            loss.backward()
            opt.step()
            if k >= 2:
                times.append(1e3 * (time.perf_counter() - t0))
        adapters = sum(p.numel() for p in params)
    return {
        "contender": contender,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "peak_mib": (_status("VmHWM") - base_rss) / 1024,
        "adapter_parameters": int(adapters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    parser.add_argument("--workdir", help="keep the exported models here (and reuse them)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = (args.hidden, args.layers)
    if args.child:
        result = child(args.child, args.path, *sizes, args.batch, args.seq, args.steps, args.threads)
        print(json.dumps(result))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(args.workdir or tmp, f"llama-{args.hidden}x{args.layers}-{args.batch}x{args.seq}")
        if not os.path.exists(f"{path}-4bit.onnx"):
            export(path, *sizes, args.batch, args.seq)
        for name in ("float", "4bit"):
            print(f"{name} model: {os.path.getsize(f'{path}-{name}.onnx') / 2**20:.1f} MiB")
        for contender in CONTENDERS:
            cmd = [sys.executable, __file__, "--child", contender, "--path", path]
            cmd += [
                f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "batch", "seq", "steps", "threads")
            ]
            env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                raise SystemExit(f"{contender} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(result)
            print(
                f"{contender:15s} step {result['median_ms']:8.1f} ms (min {result['min_ms']:.1f}) "
                f"peak +{result['peak_mib']:.0f} MiB, {result['adapter_parameters']} adapter parameters"
            )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
