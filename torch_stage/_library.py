"""Locating and loading the compiled torch_stage library."""

import os

import torch

_ENV = "TORCH_STAGE_LIBRARY"
_HERE = os.path.dirname(os.path.abspath(__file__))


def library_path() -> str:
    """Path of ``libtorch_stage.so``, the library C++ programs link or load.

    ``TORCH_STAGE_LIBRARY`` overrides it (for relocated installs).
    """
    return os.environ.get(_ENV) or os.path.join(_HERE, "lib", "libtorch_stage.so")


def load():
    """Load the operators and custom classes into torch (once) and return the
    ``torch_stage._C`` bindings module.

    Raises one ImportError that says what to do, never a chain of tracebacks.
    """
    path = library_path()
    if path not in torch.ops.loaded_libraries:
        _load_library(path)
    try:
        from torch_stage import _C
    except ImportError as exc:
        raise ImportError(
            f"torch_stage's Python bindings (torch_stage._C) could not be imported: "
            f"{exc}. Rebuild them with `make build` "
            "(or `pip install --no-build-isolation -e .`)."
        ) from None
    return _C


def _load_library(path: str) -> None:
    if not os.path.exists(path):
        raise ImportError(
            f"torch_stage's compiled library is missing: {path} does not exist. "
            "Build it from the source tree with `make build` "
            "(or `pip install --no-build-isolation -e .`)."
        ) from None
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        raise ImportError(
            f"torch_stage could not load {path}: {exc}. The library was probably "
            f"built against another torch than the installed {torch.__version__}; "
            "rebuild it with `make build`."
        ) from None
