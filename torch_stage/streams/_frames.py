"""Functions whose frames Dynamo never compiles, set without importing Dynamo.

``torch.compiler.disable`` imports ``torch._dynamo`` (over a second, and it
imports inductor's configuration, which sets ``TORCHINDUCTOR_CACHE_DIR`` in
the environment child processes inherit): importing torch_stage must not.
This sets the same per-code frame strategy that ``torch._dynamo.skip_code``
sets, from ``torch._C``. A frame strategy is read when a function runs as a
frame of its own (called from code Dynamo does not trace); inside a frame
Dynamo traces, a function is inlined as before.
"""

from __future__ import annotations

from typing import Callable

__all__ = ["skip_frames"]


def skip_frames(*functions: Callable, nested: bool = False) -> None:
    """Dynamo never compiles a frame of ``functions`` (nor, with ``nested``,
    the frames they call, as ``torch.compiler.disable`` would). On a torch
    whose ``torch._C._dynamo`` has no frame strategies nothing changes."""
    try:
        from torch._C._dynamo import eval_frame

        action = eval_frame._FrameAction
        strategy = eval_frame._FrameExecStrategy(
            action.SKIP, action.SKIP if nested else action.DEFAULT
        )
    except (ImportError, AttributeError):
        return
    for f in functions:
        eval_frame.set_code_exec_strategy(f.__code__, strategy)
