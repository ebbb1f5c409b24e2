"""nextstate: an OpenAI-compatible inference proxy that learns online.

The top package is the composition root: `app` builds the long-lived objects and wires them,
`cli` is the `nextstate` command. Each layer below is a subpackage over its own repository
folder: `core`, `modelio`, `engine`, then `proxy`, `judge` and `learner` (docs/ARCHITECTURE.md).
"""

__version__ = "0.1.0"

# Run from the root of a source checkout, Python finds this folder as `nextstate` before any
# installed copy (the current directory comes first on sys.path), while its subpackages live
# beside it (pyproject.toml's package-dir). Looking for them there too lets the tests and
# `python -m nextstate...` run from the root whichever way the checkout is installed (the
# default editable mode, or the strict one whose link tree mypy and editors read:
# docs/DEVELOPING.md). A wheel has no pyproject.toml beside its package and is left alone.
import pathlib as _pathlib

_checkout = _pathlib.Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "core" / "__init__.py").is_file():
    __path__.append(str(_checkout))
del _pathlib, _checkout
