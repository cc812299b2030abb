"""A griffe extension for the API reference (mkdocs.yml): onnxgrad's docstrings use Sphinx roles
(``:func:`~onnxgrad.gradients```) and ``::`` before literal blocks, which markdown would show as
they are. Each role becomes a code span of the name (its last part with ``~``), and a paragraph's
closing ``::`` a ``:`` (the indented block under it is already a markdown code block).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|exc|obj|const|ref):`(~?)([^`]+)`")
LITERAL = re.compile(r"(\S)::$", re.M)


def markdown(text: str) -> str:
    """``text`` with Sphinx roles as code spans and ``::`` literal markers as ``:``."""
    text = ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)
    return LITERAL.sub(r"\1:", text)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring with :func:`markdown` once the object tree is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
