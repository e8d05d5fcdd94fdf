"""Build and runtime description (printed by ``python -m torch_stage.info``)."""

import platform

import torch

from torch_stage import _library

__all__ = ["build_info"]


def build_info() -> dict:
    """How torch_stage was built and what it runs on.

    Returns:
        A dict with ``torch_version`` (the torch the library was built
        against), ``torch_runtime_version`` (the torch imported now),
        ``compiler``, ``cxx_standard``, ``cxx11_abi``, ``build_type``,
        ``build_flags``, ``assertions``, ``library`` (path of
        libtorch_stage.so), ``python``, ``cuda_available`` and
        ``cuda_device_count``.
    """
    info = dict(torch.ops.torch_stage.build_info())
    info["torch_runtime_version"] = torch.__version__
    info["library"] = _library.library_path()
    info["python"] = platform.python_version()
    info["cuda_available"] = torch.cuda.is_available()
    info["cuda_device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    return info
