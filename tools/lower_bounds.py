"""Write pip constraints that pin every dependency of onnxgrad to its declared lower bound.

``make test-oldest`` installs with these constraints, so the oldest releases that ``pyproject.toml``
promises to support are the ones that leg tests. Test tooling (pytest, ruff, ...) is not part of
that promise and comes from the lock instead.

Usage: python tools/lower_bounds.py pyproject.toml requirements/lock.txt > constraints.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

TOOLING = {"pytest", "pytest-xdist", "hypothesis", "ruff", "build", "import-linter"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].strip().lower()


def lower_bounds(pyproject: Path) -> dict[str, str]:
    """Package name -> the version its ``>=`` (or ``==``) requirement names, over every extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    bounds: dict[str, str] = {}
    for req in requirements:
        if req.startswith("onnxgrad"):
            continue
        name = _name(req)
        match = re.search(r"(>=|==)\s*([0-9][^,; ]*)", req)
        if name in TOOLING or not match:
            continue
        bounds[name] = match.group(2)
    return bounds


def main(argv: list[str]) -> int:
    pyproject, lock = Path(argv[1]), Path(argv[2])
    bounds = lower_bounds(pyproject)
    lines = [f"{name}=={version}" for name, version in sorted(bounds.items())]
    for line in lock.read_text().splitlines():  # tooling from the lock
        if line and not line.startswith("#") and _name(line) in TOOLING:
            lines.append(line)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
