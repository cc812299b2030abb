"""``python -m onnxgrad``: the command line of :mod:`onnxgrad.cli`."""

import sys

from .cli import main

sys.exit(main())
