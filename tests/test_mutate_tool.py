"""tools/mutate.py (``make mutate``): which tests cover a module, the configuration mutmut gets,
and the score read from ``mutmut results``. The mutation run itself needs mutmut (installed by the
Makefile target), so it is not run here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("mutate_tool", ROOT / "tools" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate_tool"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("mutate_tool", None)


def test_modules_by_path_or_dotted_name(mutate):
    path = mutate.module_path("src/onnxgrad/model/limits.py")
    assert path == mutate.module_path("onnxgrad.model.limits") == ROOT / "src/onnxgrad/model/limits.py"
    assert mutate.dotted(path) == "onnxgrad.model.limits"
    with pytest.raises(SystemExit, match=r"'tools/mutate.py' is not a module of src/onnxgrad"):
        mutate.module_path("tools/mutate.py")


def test_the_tests_that_name_a_module_or_import_its_names(mutate):
    tests = mutate.covering_tests([mutate.module_path("onnxgrad.model.limits")])
    assert {
        "tests/reliability/test_limits.py",  # names the module
        "tests/reliability/test_untrusted.py",  # imports Limits and default_limits from model.validate
    } <= set(tests)
    assert "tests/test_cli.py" not in tests


def test_the_configuration_and_the_score(mutate, tmp_path):
    work = tmp_path / "work"
    mutate.write_config(work, ["src/onnxgrad/model/limits.py"], ["tests/reliability/test_limits.py"])
    config = (work / "setup.cfg").read_text()
    assert "source_paths =\n    src/onnxgrad/model/limits.py\n" in config
    assert "also_copy =\n    src/onnxgrad\n" in config
    assert "pytest_add_cli_args_test_selection =\n    tests/reliability/test_limits.py\n" in config
    assert (work / "src/onnxgrad/model/limits.py").is_file() and (work / "tests/models.py").is_file()
    results = "\n".join(
        [
            "    onnxgrad.model.limits.x_f__mutmut_1: killed",
            "    onnxgrad.model.limits.x_f__mutmut_2: timeout",
            "    onnxgrad.model.limits.x_f__mutmut_3: survived",
            "    onnxgrad.model.limits.x_f__mutmut_4: no tests",
            "    onnxgrad.model.fold.x_g__mutmut_1: killed",
        ]
    )
    (line,) = mutate.scores(results, ["onnxgrad.model.limits"])
    assert line.startswith("onnxgrad.model.limits: 4 mutants, 2 killed, 1 survived, 1 other")
    assert line.endswith("score 50.0 %")
