"""Exceptions raised by torch_stage.

The C++ library tags the matching errors "[StageClosed]" and "[StageCancelled]"
(csrc/staging/staging_area.h); the Python bindings raise these classes. The
records code (csrc/records) raises a C++ RecordError whose kind the bindings
map to the RecordError subclasses below.
"""

__all__ = [
    "CorruptRecordError",
    "ExampleParseError",
    "FeatureError",
    "MultiStreamTraceError",
    "RecordError",
    "RecordFileError",
    "StageCancelled",
    "StageClosed",
    "StageError",
    "StageTimeoutError",
    "StreamRaceError",
]


class StageError(RuntimeError):
    """Base class of torch_stage's runtime errors."""


class StageClosed(StageError):
    """A staging buffer is closed: no more puts, or nothing left to take."""


class StageCancelled(StageError):
    """A staging buffer was cancelled; its waiters were woken and failed."""


class StageTimeoutError(StageError, TimeoutError):
    """A wait on a staging buffer or stage outlasted its timeout."""


class RecordError(StageError):
    """A TFRecord file or a serialized ``tf.train.Example`` cannot be used.

    The message names the file, the byte offset or the record index, and what
    was expected. The same facts are attributes (None where they do not
    apply): ``path``, ``offset`` (byte offset of the record, in the
    uncompressed stream), ``record_index`` (in its file, or in the parsed
    batch), ``key`` (the feature) and ``kind`` (a short description).
    """

    path = None
    offset = None
    record_index = None
    key = None
    kind = None


class RecordFileError(RecordError, OSError):
    """No file matches a pattern; a file cannot be opened, read or written, or
    shrank while being read; or a RecordInput with ``epochs=None`` read no
    record in a whole pass over its files (the message names them)."""


class CorruptRecordError(RecordError):
    """A TFRecord file is truncated, fails a length or data CRC check, or its
    GZIP/ZLIB stream does not decompress."""


class ExampleParseError(RecordError):
    """A record is not a serialized ``tf.train.Example``."""


class FeatureError(RecordError):
    """An Example lacks a required feature (and no default was given), or a
    feature holds the wrong list type or the wrong number of values."""


class MultiStreamTraceError(RuntimeError):
    """torch_stage.multi_stream could not trace a module with torch.fx."""


class StreamRaceError(RuntimeError):
    """Two accesses of one tensor's memory on different streams are not
    ordered by the stream plan (raised by ``torch_stage.sanitize_streams``).

    Attributes:
        race: the :class:`torch_stage.streams.sanitizer.StreamRace` found: the kind,
            both accesses (op, FX node, stream, Python stack) and the
            storage.
    """

    def __init__(self, message: str, race=None):
        super().__init__(message)
        self.race = race
