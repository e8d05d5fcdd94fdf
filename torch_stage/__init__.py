"""torch_stage: keep accelerators busy with staged prefetch and multi-stream
execution.

Importing the package loads the compiled operator library
(``torch.ops.torch_stage.*`` and ``torch.classes.torch_stage.*``).
"""

from torch_stage import _library

_C = _library.load()

from torch_stage._build_info import build_info  # noqa: E402
from torch_stage._library import library_path  # noqa: E402
from torch_stage.errors import (  # noqa: E402
    CorruptRecordError,
    ExampleParseError,
    FeatureError,
    MultiStreamTraceError,
    RecordError,
    RecordFileError,
    StageCancelled,
    StageClosed,
    StageError,
    StageTimeoutError,
    StreamRaceError,
)
from torch_stage.observe.tracing import Trace, trace  # noqa: E402
from torch_stage.records.example import (  # noqa: E402
    FixedLenFeature,
    Ragged,
    VarLenFeature,
    encode_example,
    parse_example,
)
from torch_stage.records.record_input import RecordDataset, RecordInput  # noqa: E402
from torch_stage.records.record_io import RecordBatch, RecordWriter, read_records  # noqa: E402
from torch_stage.staging import integrations  # noqa: E402, F401  (torch_stage.staging.integrations)
from torch_stage.staging.area import StagingArea  # noqa: E402
from torch_stage.staging.loader import DataLoader  # noqa: E402
from torch_stage.staging.stage import (  # noqa: E402
    Stage,
    add_stage_thread_pool,
    make_prefetch_hook,
    staged,
)
from torch_stage.streams import compile_backend as _compile_backend  # noqa: E402
from torch_stage.streams.compile_backend import Backend, backend  # noqa: E402
from torch_stage.streams.cuda_graphs import CUDAGraphModule  # noqa: E402
from torch_stage.streams.multi_stream import (  # noqa: E402
    MAX_STREAMS,
    STRATEGIES,
    colocate_with,
    multi_stream,
    stream,
)
from torch_stage.streams.sanitizer import sanitize_streams  # noqa: E402

__version__ = "0.1.0"

# backend="torch_stage" without an installed entry point (a source checkout).
_compile_backend._register()

# TORCH_STAGE_SANITIZE=1: the stream sanitizer for the whole process.
from torch_stage.streams import sanitizer as _sanitizer  # noqa: E402

_process_sanitizer = _sanitizer._enable_from_environment()

__all__ = [
    "Backend",
    "CUDAGraphModule",
    "CorruptRecordError",
    "DataLoader",
    "ExampleParseError",
    "FeatureError",
    "FixedLenFeature",
    "MAX_STREAMS",
    "MultiStreamTraceError",
    "Ragged",
    "RecordBatch",
    "RecordDataset",
    "RecordError",
    "RecordFileError",
    "RecordInput",
    "RecordWriter",
    "STRATEGIES",
    "Stage",
    "StageCancelled",
    "StageClosed",
    "StageError",
    "StageTimeoutError",
    "StagingArea",
    "StreamRaceError",
    "Trace",
    "VarLenFeature",
    "add_stage_thread_pool",
    "backend",
    "build_info",
    "colocate_with",
    "encode_example",
    "library_path",
    "make_prefetch_hook",
    "multi_stream",
    "parse_example",
    "read_records",
    "sanitize_streams",
    "staged",
    "stream",
    "trace",
]
