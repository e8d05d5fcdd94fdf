"""torch_stage: keep accelerators busy with staged prefetch and multi-stream
execution.

Importing the package loads the compiled operator library
(``torch.ops.torch_stage.*`` and ``torch.classes.torch_stage.*``).
"""

from torch_stage import _library

_C = _library.load()

from torch_stage import fx  # noqa: E402, F401  (torch_stage.fx and its op registrations)
from torch_stage._build_info import build_info  # noqa: E402
from torch_stage._library import library_path  # noqa: E402
from torch_stage.errors import (  # noqa: E402
    MultiStreamTraceError,
    StageCancelled,
    StageClosed,
    StageError,
    StageTimeoutError,
)
from torch_stage.staging import StagingArea  # noqa: E402
from torch_stage.streams import (  # noqa: E402
    MAX_STREAMS,
    STRATEGIES,
    colocate_with,
    multi_stream,
    stream,
)

__version__ = "0.1.0"

__all__ = [
    "MAX_STREAMS",
    "MultiStreamTraceError",
    "STRATEGIES",
    "StageCancelled",
    "StageClosed",
    "StageError",
    "StageTimeoutError",
    "StagingArea",
    "build_info",
    "colocate_with",
    "library_path",
    "multi_stream",
    "stream",
]
