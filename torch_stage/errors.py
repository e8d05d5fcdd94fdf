"""Exceptions raised by torch_stage.

The C++ library tags the matching errors "[StageClosed]" and "[StageCancelled]"
(csrc/staging/staging_area.h); the Python bindings raise these classes.
"""

__all__ = [
    "MultiStreamTraceError",
    "StageCancelled",
    "StageClosed",
    "StageError",
    "StageTimeoutError",
]


class StageError(RuntimeError):
    """Base class of torch_stage's runtime errors."""


class StageClosed(StageError):
    """A staging buffer is closed: no more puts, or nothing left to take."""


class StageCancelled(StageError):
    """A staging buffer was cancelled; its waiters were woken and failed."""


class StageTimeoutError(StageError, TimeoutError):
    """A wait on a staging buffer or stage outlasted its timeout."""


class MultiStreamTraceError(RuntimeError):
    """torch_stage.multi_stream could not trace a module with torch.fx."""
