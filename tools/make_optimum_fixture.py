"""Write tests/data/optimum_gpt2_merged.onnx: optimum's merged decoder (``decoder_model_merged.onnx``,
one graph with a top-level ``If`` on ``use_cache_branch``) of a tiny random GPT-2, as
``optimum-cli export onnx --task text-generation-with-past`` writes it.

Needs optimum-onnx (not a dependency of onnxgrad): run it in a venv of its own, e.g.

    python3 -m venv /tmp/optimum && /tmp/optimum/bin/pip install torch==2.13.0 optimum-onnx pytest
    PYTHONPATH=src:. /tmp/optimum/bin/python tools/make_optimum_fixture.py

(written with optimum-onnx 0.1.0, optimum 2.1.0, transformers 4.57.6, torch 2.13.0). The model is
built from :data:`CONFIG` with seed 0 (no download), its parameters perturbed as the zoo's are
(``tests.zoo._util.perturb``: every float32 element distinct, so that no two initializers are
merged as equal and each initializer element maps back to one parameter element).
tests/zoo/test_optimum_merged.py builds the same GPT-2 in torch and loads the file's weights into it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

#: the tiny GPT-2's configuration (kept in step with the test that reads the fixture)
CONFIG = dict(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, n_inner=64)


OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "optimum_gpt2_merged.onnx"


def main(out: Path = OUT) -> None:
    import onnx
    import torch
    from optimum.exporters.onnx import export
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx import merge_decoders
    from tests.zoo._util import perturb
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG)).eval()
    perturb(model)
    # optimum-onnx 0.1 exports one model.onnx by default; decoder_model_merged.onnx is what its
    # former (--legacy) export wrote, and its own steps still write it: the decoder without past
    # inputs, the decoder with them, merged by optimum.onnx.merge_decoders
    gpt2 = TasksManager.get_exporter_config_constructor(
        "onnx", model, task="text-generation-with-past", library_name="transformers"
    )
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for name, past_in in [("decoder_model", False), ("decoder_with_past_model", True)]:
            config = gpt2(model.config, task="text-generation", use_past=True, use_past_in_inputs=past_in)
            paths.append(Path(tmp) / f"{name}.onnx")
            export(model, config, paths[-1])
        merge_decoders(paths[0], paths[1], save_path=Path(tmp) / "decoder_model_merged.onnx")
        merged = onnx.load(Path(tmp) / "decoder_model_merged.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(merged, out)
    print(f"wrote {out} ({out.stat().st_size} bytes, opset {merged.opset_import[0].version})")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
