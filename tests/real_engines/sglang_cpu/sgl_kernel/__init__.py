"""A stand-in for SGLang's CPU kernel package, for tests on machines without it.

SGLang's CPU build of `sgl-kernel` is not on PyPI (the PyPI wheels are CUDA builds) and cannot be
built here, yet SGLang imports kernel names from it at start-up even on its torch-native CPU
path. This package answers those imports; calling a kernel it does not provide raises, so a
test can never pass on math this package made up. Only bookkeeping helpers the torch-native path
really calls are written out, in plain torch (see each one).
"""

from __future__ import annotations

__version__ = "0.0.0+nextstate-stand-in"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not provided by nextstate's test stand-in")

    missing.__name__ = name
    return missing
