"""What an artifacts folder and its runner refuse or survive (issues 37 §11, §17; 38 §3, §6; 39).

* the learning rate and the optimizer's hyperparameters: checked in one place
  (:func:`onnxgrad.train.optimizers.check_lr`, the registry's ``resolve``), refused by every door
  with the same :class:`InputError`;
* an untrusted folder: its files inside it, no symbolic link, its models checked as any model
  file, its state checked against the manifest, each bad file one typed error;
* a non-finite loss: the update skipped, counted, an error after ``max_consecutive_skips``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxgrad.artifacts import Runner, generate, tensors
from onnxgrad.cli import main
from onnxgrad.demo import build_mlp
from onnxgrad.errors import InputError, ModelError, OnnxGradError, OnnxGradRuntimeError
from onnxgrad.train import Trainer
from onnxgrad.train.optimizers import check_lr, definition

LR_MESSAGE = r"lr must be >= 0, got {}: a finite number"


def small_mlp() -> onnx.ModelProto:
    return build_mlp((8, 16, 4), np.random.default_rng(0))


def batch(n: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"pixels": rng.random((n, 8)).astype(np.float32), "target": rng.integers(0, 4, n)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "art"
    generate(small_mlp(), loss="cross_entropy", optimizer="adamw", lr=1e-2, out_dir=out)
    return out


def copy_of(folder, tmp_path, name: str = "copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


# ---- the learning rate and the hyperparameters: one check, every door --------------------------
BAD_LRS = [-1.0, float("nan"), float("inf")]


@pytest.mark.parametrize("lr", [1e39, "0.01", True, b"1"])
def test_a_rate_beyond_float32_or_not_a_number_is_refused(lr, folder):
    """1e39 overflowed the float32 update: every parameter inf or NaN, a normal loss reported, and
    a saved state its own loader refused. A string or a bool is no rate (JavaScript's rule)."""
    message = (
        r"lr must be at most 3.4028234663852886e\+38 \(float32's largest value\), got 1e\+39"
        if lr == 1e39
        else rf"lr must be a number (>= 0|or a callable step -> lr), got {re.escape(repr(lr))}"
    )
    with pytest.raises(InputError, match=message):
        check_lr(lr)
    with pytest.raises(InputError, match=message):
        Runner(folder, lr=lr)
    with pytest.raises(InputError, match=message):
        Runner(folder, lr=lambda step: lr)
    assert check_lr(3.4028234663852886e38) == 3.4028234663852886e38
    assert check_lr(np.float32(0.5)) == 0.5


@pytest.mark.parametrize("lr", BAD_LRS)
def test_every_door_refuses_a_bad_learning_rate_with_the_same_error(lr, folder, tmp_path, capsys):
    message = LR_MESSAGE.format(lr)
    with pytest.raises(InputError, match=message):
        check_lr(lr)
    with pytest.raises(InputError, match=message):
        generate(small_mlp(), loss="cross_entropy", lr=lr)
    with pytest.raises(InputError, match=message):
        Runner(folder, lr=lr)
    with pytest.raises(InputError, match=message):
        Runner(folder, lr=lambda step: lr)  # a schedule's value
    runner = Runner(folder, lr=lambda step: 0.01 if step == 0 else lr)
    runner.step(batch())
    with pytest.raises(InputError, match=message):
        runner.step(batch())
    assert runner.iterations == 1
    with pytest.raises(InputError, match=message):
        Trainer(small_mlp(), loss="cross_entropy", lr=lr)
    model = tmp_path / "mlp.onnx"
    onnx.save(small_mlp(), model)
    capsys.readouterr()
    assert (
        main(["artifacts", str(model), "--loss", "cross_entropy", "--lr", str(lr), "-o", str(tmp_path / "o")])
        == 2
    )
    assert "lr must be >= 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing written
    data = tmp_path / "data.npz"
    np.savez(data, pixels=batch()["pixels"], target=batch()["target"])
    argv = ["train", str(model), "--data", str(data), "--target", "target", "--loss", "cross_entropy"]
    assert main([*argv, "--lr", str(lr), "-o", str(tmp_path / "t.onnx"), "--no-progress"]) == 2
    assert "lr must be >= 0" in capsys.readouterr().err


def test_a_manifest_with_a_bad_default_rate_is_refused(folder, tmp_path):
    bad = copy_of(folder, tmp_path)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["lr"]["default"] = -1
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=LR_MESSAGE.format(-1.0)):
        Runner(bad)


@pytest.mark.parametrize(
    ("optimizer", "options", "message"),
    [
        ("adamw", {"betas": (0.9, 1.0)}, r"betas must be in \[0, 1\)"),
        ("adam", {"betas": (float("nan"), 0.9)}, r"betas must be in \[0, 1\)"),
        ("adamw", {"eps": 0.0}, r"eps must be a finite number > 0, got 0\.0"),
        ("adamw", {"eps": float("inf")}, r"eps must be a finite number > 0"),
        ("adamw", {"weight_decay": -0.1}, r"weight_decay must be a finite number >= 0"),
        ("sgd", {"momentum": float("inf")}, r"momentum must be a finite number >= 0"),
        ("sgd", {"momentum": -0.5}, r"momentum must be a finite number >= 0"),
        ("sgd", {"momentum": "high"}, r"momentum must be a number, got 'high'"),
    ],
)
def test_every_door_refuses_bad_hyperparameters_with_the_same_error(
    optimizer, options, message, tmp_path, capsys
):
    with pytest.raises(InputError, match=message):
        definition(optimizer).resolve(options)
    with pytest.raises(InputError, match=message):
        generate(small_mlp(), loss="cross_entropy", optimizer=optimizer, optimizer_options=options)
    with pytest.raises(InputError, match=message):
        Trainer(small_mlp(), loss="cross_entropy", optimizer=optimizer, optimizer_options=options)
    if optimizer == "sgd" and isinstance(options["momentum"], float):
        model = tmp_path / "mlp.onnx"
        onnx.save(small_mlp(), model)
        capsys.readouterr()
        argv = ["artifacts", str(model), "--loss", "cross_entropy", "--optimizer", "sgd"]
        assert main([*argv, "--momentum", str(options["momentum"]), "-o", str(tmp_path / "o")]) == 2
        assert "momentum must be a finite number >= 0" in capsys.readouterr().err


# ---- a non-finite loss -------------------------------------------------------------------------
def test_a_nan_batch_skips_the_update_and_is_counted(folder):
    runner = Runner(folder, threads=1)
    runner.step(batch(seed=1))
    before = runner.state_dict()
    poisoned = batch(seed=2)
    poisoned["pixels"][3, 2] = np.nan
    with pytest.warns(UserWarning, match=r"the loss is nan at update 1: the update was skipped"):
        loss = runner.step(poisoned)
    assert np.isnan(loss)
    assert runner.iterations == 1 and runner.skipped_steps == 1 and runner.consecutive_skips == 1
    for name, value in runner.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    # the next good batch is the update an uninterrupted run makes next
    reference = Runner(folder, threads=1)
    reference.step(batch(seed=1))
    assert runner.step(batch(seed=3)) == reference.step(batch(seed=3))
    assert runner.consecutive_skips == 0 and runner.skipped_steps == 1
    for name, value in runner.state_dict().items():
        np.testing.assert_array_equal(value, reference.state_dict()[name], err_msg=name)


def test_consecutive_non_finite_losses_raise_at_the_limit(folder):
    runner = Runner(folder, threads=1, max_consecutive_skips=3)
    start = runner.state_dict()
    poisoned = batch()
    poisoned["pixels"][0, 0] = np.inf
    with pytest.warns(UserWarning, match="skipped"):
        runner.step(poisoned)
        runner.step(poisoned)
    with pytest.raises(OnnxGradRuntimeError, match=r"3 skipped in a row, the limit max_consecutive_skips=3"):
        runner.step(poisoned)
    assert runner.iterations == 0 and runner.skipped_steps == 3
    for name, value in runner.state_dict().items():
        np.testing.assert_array_equal(value, start[name], err_msg=name)
    with pytest.raises(InputError, match="max_consecutive_skips must be an integer >= 1"):
        Runner(folder, max_consecutive_skips=0)


def test_the_default_limit_is_five(folder):
    runner = Runner(folder, threads=1)
    poisoned = batch()
    poisoned["pixels"][:] = np.nan
    with pytest.warns(UserWarning):
        for _ in range(4):
            runner.step(poisoned)
        with pytest.raises(OnnxGradRuntimeError, match="5 skipped in a row"):
            runner.step(poisoned)


# ---- the state file ----------------------------------------------------------------------------
def write_state(path, arrays, meta) -> None:
    tensors.save(path, arrays, meta)


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("-1", r"its step \(the updates already made\) is '-1', not a whole number"),
        ("nan", r"its step .* is 'nan'"),
        ("1.5", r"its step .* is '1.5'"),
        (str(2**63), r"its step .* is '9223372036854775808'"),
        ("9" * 400, r"its step .* is '999"),
        ("007", r"its step .* is '007', not a whole number .* without leading zeros"),
        (None, r"does not record its step \(the updates already made: 'step' in its __metadata__\)"),
    ],
)
def test_a_bad_step_in_the_state_is_refused(step, message, folder, tmp_path):
    values, _ = tensors.load(folder / "state.safetensors")
    path = tmp_path / "s.safetensors"
    write_state(path, values, {"format": "onnxgrad.artifacts"} if step is None else {"step": step})
    with pytest.raises(InputError, match=message):
        Runner(folder, state=path)
    if step is None:  # no metadata at all: refused the same
        write_state(path, values, None)
        with pytest.raises(InputError, match=message):
            Runner(folder, state=path)


def test_a_step_count_that_cannot_advance_is_refused_not_overflowed(folder, tmp_path):
    """A state at step 2**63 - 1 once stepped to 2**63 (a state its loader refuses) and then
    raised a raw OverflowError."""
    values, _ = tensors.load(folder / "state.safetensors")
    path = tmp_path / "s.safetensors"
    write_state(path, values, {"step": str(2**63 - 2)})
    runner = Runner(folder, state=path)
    runner.step(batch())
    assert runner.iterations == 2**63 - 1
    before = runner.state_dict()
    with pytest.raises(
        OnnxGradRuntimeError, match=r"the step count is 9223372036854775807, the largest an int64"
    ):
        runner.step(batch())
    assert runner.iterations == 2**63 - 1
    for name, value in runner.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    assert Runner(folder, state=runner.save_state(tmp_path / "last.safetensors")).iterations == 2**63 - 1


def test_a_negative_second_moment_in_the_state_is_refused(folder, tmp_path):
    """A negative exp_avg_sq passed the finite check and made its parameter NaN at the next step."""
    values, _ = tensors.load(folder / "state.safetensors")
    values["exp_avg_sq/fc2.bias"] = values["exp_avg_sq/fc2.bias"].copy()
    values["exp_avg_sq/fc2.bias"][1] = -1.0
    values["exp_avg/fc2.bias"] = np.full_like(values["exp_avg/fc2.bias"], -1.0)  # a first moment may be < 0
    path = tmp_path / "s.safetensors"
    write_state(path, values, {"step": "3"})
    with pytest.raises(
        InputError, match=r"tensor 'exp_avg_sq/fc2.bias' holds 1 negative values, which a second"
    ):
        Runner(folder, state=path)
    values["exp_avg_sq/fc2.bias"][1] = 0.0
    write_state(path, values, {"step": "3"})
    runner = Runner(folder, state=path)
    runner.step(batch())
    assert all(np.isfinite(v).all() for v in runner.parameters.values())


def test_safetensors_with_overlapping_tensors_or_trailing_bytes_are_refused(folder, tmp_path):
    raw = (folder / "state.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    path = tmp_path / "s.safetensors"
    path.write_bytes(raw + b"\0" * 16)
    with pytest.raises(InputError, match=r"has 16 bytes after its last tensor"):
        Runner(folder, state=path)
    # two tensors of one size made to share their bytes: the file keeps its length
    a = next(k for k in header if k != "__metadata__" and k.startswith("exp_avg/"))
    size = header[a]["data_offsets"][1] - header[a]["data_offsets"][0]
    same = [
        k
        for k in header
        if k != "__metadata__"
        and k != a
        and header[k]["data_offsets"][1] - header[k]["data_offsets"][0] == size
    ]
    header[same[0]]["data_offsets"] = list(header[a]["data_offsets"])
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(InputError, match=r"overlaps the tensor before it|leaves bytes"):
        Runner(folder, state=path)


def test_the_state_must_match_the_manifest(folder, tmp_path):
    values, meta = tensors.load(folder / "state.safetensors")
    path = tmp_path / "s.safetensors"
    name = "exp_avg/fc1.weight"
    cases = {
        "nan": (
            {**values, name: np.full_like(values[name], np.nan)},
            rf"tensor '{name}' holds \d+ non-finite",
        ),
        "inf": ({**values, "fc2.bias": np.full_like(values["fc2.bias"], -np.inf)}, r"'fc2.bias' holds 4 non"),
        "dtype": (
            {**values, name: values[name].astype(np.float64)},
            rf"'{name}' is float64 \[8, 16\], the folder carries float32",
        ),
        "shape": ({**values, name: values[name][:3]}, rf"'{name}' is float32 \[3, 16\]"),
        "missing": ({k: v for k, v in values.items() if k != name}, rf"lacks \['{name}'\]"),
        "extra": (
            {**values, "other": np.zeros(2, np.float32)},
            r"holds \['other'\], which the folder does not carry",
        ),
    }
    for what, (arrays, message) in cases.items():
        write_state(path, arrays, meta)
        with pytest.raises(InputError, match=message):
            Runner(folder, state=path)
        assert what


def _header_file(path, header: bytes) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header)


def test_bad_state_files_are_one_typed_error(folder, tmp_path):
    """Each of these raised a bare exception (OSError, TypeError, RecursionError...)."""
    cases = {}
    listed = tmp_path / "list.safetensors"
    _header_file(listed, b"[1, 2, 3]")
    cases["a list as the JSON header"] = (listed, "its header is not a JSON object")
    nested = tmp_path / "nested.safetensors"
    _header_file(nested, b"[" * 100_000 + b"]" * 100_000)
    cases["deeply nested JSON"] = (nested, "is not a safetensors file")
    meta = tmp_path / "meta.safetensors"
    _header_file(meta, b'{"__metadata__": {"step": 3}}')
    cases["a number as metadata"] = (meta, "__metadata__ is not a string mapping")
    cases["a directory"] = (tmp_path, "is not a regular file")
    big = tmp_path / "big.safetensors"
    with open(big, "wb") as f:
        f.truncate(1 << 26)  # sparse: 64 MiB of nothing, more than the folder's few KB
    cases["a huge file"] = (big, r"has 67108864 bytes, more than the \d+ bytes")
    if os.path.exists("/proc/self/mem"):
        cases["/proc/self/mem"] = ("/proc/self/mem", "cannot read the safetensors file")
    for what, (path, message) in cases.items():
        with pytest.raises(InputError, match=message):
            Runner(folder, state=path)
        assert what


# ---- the folder's files ------------------------------------------------------------------------
def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def _set_file(folder, key: str, value) -> None:
    manifest = _manifest(folder)
    manifest["files"][key] = value
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_the_folder_files_stay_inside_it(folder, tmp_path):
    evil = tmp_path / "outside"
    evil.mkdir()
    shutil.copy(folder / "train_step.onnx", evil / "evil.onnx")
    bad = copy_of(folder, tmp_path)
    _set_file(bad, "train_step", "../outside/evil.onnx")
    with pytest.raises(ModelError, match=r"files.train_step is '../outside/evil.onnx', which points outside"):
        Runner(bad)
    _set_file(bad, "train_step", str(evil / "evil.onnx"))
    with pytest.raises(ModelError, match=r"files.train_step is .*, an absolute path"):
        Runner(bad)
    _set_file(bad, "train_step", "train_step.onnx")
    os.remove(bad / "state.safetensors")
    os.symlink(folder / "state.safetensors", bad / "state.safetensors")
    with pytest.raises(ModelError, match=r"files.state is 'state.safetensors', a symbolic link"):
        Runner(bad)
    os.remove(bad / "state.safetensors")
    os.symlink("train_step.onnx", bad / "state.safetensors")  # even one inside the folder
    with pytest.raises(ModelError, match="a symbolic link"):
        Runner(bad)
    os.remove(bad / "state.safetensors")
    shutil.copy(folder / "state.safetensors", bad / "state.safetensors")
    _set_file(bad, "eval_step", ["a"])
    with pytest.raises(InputError, match=r"files\.eval_step is not a file name"):
        Runner(bad)
    _set_file(bad, "eval_step", "eval_step.onnx")
    _set_file(bad, "manifest", "../outside/manifest.json")  # every entry, even one the runner skips
    shutil.copy(bad / "manifest.json", evil / "manifest.json")
    with pytest.raises(
        ModelError, match=r"files.manifest is '../outside/manifest.json', which points outside"
    ):
        Runner(bad)


def test_the_step_model_is_an_untrusted_model(folder, tmp_path):
    bad = copy_of(folder, tmp_path)
    shutil.copy("/etc/passwd" if os.path.exists("/etc/passwd") else __file__, bad / "train_step.onnx")
    with pytest.raises(ModelError, match="not a valid ONNX file"):
        Runner(bad)
    # a step graph that asks for 2**40 floats when it runs
    step = onnx.load(folder / "train_step.onnx")
    g = step.graph
    shape = helper.make_tensor("huge_shape", TensorProto.INT64, [1], [2**40])
    g.initializer.append(shape)
    g.node.append(helper.make_node("ConstantOfShape", ["huge_shape"], ["huge"]))
    g.output.append(helper.make_tensor_value_info("huge", TensorProto.FLOAT, None))
    onnx.save(step, bad / "train_step.onnx")
    with pytest.raises(ModelError, match=r"'huge'.*TiB"):
        Runner(bad)


def test_a_manifest_from_another_optimizer_or_batch_dtype_is_refused_at_load(folder, tmp_path):
    """A manifest copied from an Adam folder loaded into the AdamW one (optimizer and its defaults
    wrong); a batch dtype edited to int32 failed only at the first step, in onnxruntime's words."""
    other = tmp_path / "adam"
    generate(small_mlp(), loss="cross_entropy", optimizer="adam", lr=1e-3, out_dir=other)
    bad = copy_of(folder, tmp_path)
    shutil.copy(other / "manifest.json", bad / "manifest.json")
    with pytest.raises(
        ModelError, match=r"the step updates with \{'name': 'adamw'.*the manifest says \{'name': 'adam',"
    ):
        Runner(bad)
    bad = copy_of(folder, tmp_path, "dtype")
    manifest = _manifest(bad)
    next(s for s in manifest["batch"] if s["name"] == "target")["dtype"] = "int32"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match=r"batch input 'target' is int64, the manifest says int32"):
        Runner(bad)


def test_a_manifest_of_a_head_only_folder_is_blamed(folder, tmp_path):
    """A manifest from a folder training fewer parameters: the manifest is blamed, as in JavaScript."""
    other = tmp_path / "head"
    generate(small_mlp(), loss="cross_entropy", trainable=["fc2.weight", "fc2.bias"], out_dir=other)
    bad = copy_of(folder, tmp_path)
    shutil.copy(other / "manifest.json", bad / "manifest.json")
    with pytest.raises(ModelError, match=r"not described \(was the manifest copied from another folder\?\)"):
        Runner(bad)


def test_a_step_graph_that_does_not_match_the_manifest(folder, tmp_path):
    bad = copy_of(folder, tmp_path)
    other = tmp_path / "other"
    generate(build_mlp((8, 5, 4), np.random.default_rng(0)), loss="cross_entropy", out_dir=other)
    shutil.copy(other / "train_step.onnx", bad / "train_step.onnx")
    with pytest.raises(
        ModelError, match=r"input 'fc1.weight' is float32 \[8, 5\], the manifest says float32 \[8, 16\]"
    ):
        Runner(bad)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.pop("loss"), "'loss' is not a dict"),
        (
            lambda m: m["parameters"].append({"name": "x", "dtype": "float32", "shape": [-1]}),
            "is not a tensor entry",
        ),
        (lambda m: m["train_step"]["feedback"].popitem(), "train_step.feedback feeds"),
        (lambda m: m.__setitem__("format", "other"), "is not an onnxgrad artifacts folder"),
        (
            lambda m: m.__setitem__("version", 2),
            "is corrupt: its version is 2; this onnxgrad reads version 1",
        ),
        (
            lambda m: m["optimizer"].__setitem__("betas", [1.5, 0.999]),
            r"is corrupt: optimizer: betas must be in \[0, 1\)",
        ),
        (
            lambda m: m["optimizer"].__setitem__("name", "sgd"),
            r"is corrupt: optimizer: unknown option\(s\) \['betas', 'eps'\] of optimizer 'sgd'",
        ),
    ],
)
def test_a_corrupt_manifest_is_an_input_error(change, message, folder, tmp_path):
    bad = copy_of(folder, tmp_path)
    manifest = _manifest(bad)
    change(manifest)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InputError, match=message):
        Runner(bad)


def test_a_manifest_that_is_not_json(folder, tmp_path):
    bad = copy_of(folder, tmp_path)
    (bad / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(InputError, match="cannot read the manifest"):
        Runner(bad)
    (bad / "manifest.json").write_bytes(b"\xff\xfe")
    with pytest.raises(OnnxGradError):
        Runner(bad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_batch_the_loss_counts_nothing_of_is_a_skipped_step(reduction, tmp_path):
    """An empty batch, or one whose every label is the ignore_index, made a loss of 0.0 (or NaN)
    and still moved the parameters by weight decay: skipped before anything runs, as the Trainer
    skips such a batch, not counted as a divergence."""
    out = tmp_path / reduction
    options = {"ignore_index": 3, "reduction": reduction}
    generate(small_mlp(), loss="cross_entropy", loss_options=options, optimizer="adamw", out_dir=out)
    runner = Runner(out)
    before = runner.state_dict()
    empty = {"pixels": np.zeros((0, 8), np.float32), "target": np.zeros(0, np.int64)}
    ignored = {"pixels": batch()["pixels"], "target": np.full(8, 3)}
    for _ in range(2 * runner.max_consecutive_skips):  # never the divergence limit
        for b in (empty, ignored):
            with pytest.warns(
                UserWarning, match=r"the batch has no row the loss counts .*the update was skipped"
            ):
                assert np.isnan(runner.step(b))
    assert runner.iterations == 0 and runner.consecutive_skips == 0
    assert runner.skipped_steps == 4 * runner.max_consecutive_skips
    for name, value in runner.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    partly = {"pixels": batch()["pixels"], "target": np.array([3, 0, 3, 1, 3, 3, 3, 3])}
    assert np.isfinite(runner.step(partly)) and runner.iterations == 1


def test_loss_options_are_add_loss_keywords(tmp_path):
    """ignore_index is a class loss's option; a name add_loss does not take was a raw TypeError."""
    out = tmp_path / "ign"
    generate(small_mlp(), loss="cross_entropy", loss_options={"ignore_index": 3}, out_dir=out)
    assert Runner(out).loss_spec.ignore_index == 3
    with pytest.raises(
        InputError, match=r"unknown loss option\(s\) \['ignore'\]; the loss takes \[.*'ignore_index'"
    ):
        generate(small_mlp(), loss="cross_entropy", loss_options={"ignore": 3})
    with pytest.raises(InputError, match=r"unknown loss option\(s\) \['loss_name'\]"):
        generate(small_mlp(), loss="cross_entropy", loss_options={"loss_name": "l"})
