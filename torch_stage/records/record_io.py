"""TFRecord files in C++: :func:`read_records`, :class:`RecordWriter`, and
:class:`RecordBatch`, the form a batch of serialized records travels in (one
flat ``uint8`` tensor and ``int64`` offsets, not one Python ``bytes`` per
record).

The framing, CRC32C and GZIP/ZLIB are implemented in
``csrc/records/record_io.cpp`` (plain C++ + zlib); heavy work runs with the
GIL released.
"""

from __future__ import annotations

import os
from typing import Iterator, List, NamedTuple, Optional, Sequence, Union

import torch

from torch_stage import _C
from torch_stage._checks import check_int

__all__ = ["RecordBatch", "RecordWriter", "read_records"]

PathLike = Union[str, "os.PathLike[str]"]
# --------------------------------------------------------------- checks


def _check_compression(compression) -> Optional[str]:
    if compression is None:
        return None
    if not isinstance(compression, str) or compression.upper() not in ("", "NONE", "GZIP", "ZLIB"):
        raise ValueError(f'compression must be None, "", "GZIP" or "ZLIB", got {compression!r}')
    return compression


def _patterns(path_or_pattern, name: str = "path_or_pattern") -> List[str]:
    if isinstance(path_or_pattern, (str, os.PathLike)):
        items = [path_or_pattern]
    elif isinstance(path_or_pattern, (list, tuple)) and path_or_pattern:
        items = list(path_or_pattern)
    else:
        raise TypeError(
            f"{name} must be a path or glob pattern (str or os.PathLike) or a non-empty "
            f"list of them, got {type(path_or_pattern).__name__} ({path_or_pattern!r})"
        )
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"{name} entries must be str or os.PathLike, got {item!r}")
        out.append(_check_path(os.fspath(item), name))
    return out


def _check_path(path, name: str):
    # The C++ side takes a C string, which ends at the first NUL: the file
    # opened would be another one than the one named.
    if ("\0" if isinstance(path, str) else b"\0") in path:
        raise ValueError(f"{name} must not contain a NUL byte, got {path!r}")
    return path


# --------------------------------------------------------------- batches


class RecordBatch(NamedTuple):
    """Serialized records back to back: record ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``.

    A plain tuple of two tensors, so it pins, moves and collates like any
    tuple of tensors (``torch.utils.data`` maps over named tuples).

    Attributes:
        data: ``uint8`` tensor of every record's bytes.
        offsets: ``int64`` tensor of ``num_records + 1`` offsets into ``data``.
    """

    data: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_records(self) -> int:
        return self.offsets.numel() - 1

    def record(self, i: int) -> bytes:
        """Record ``i`` as bytes."""
        n = self.num_records
        if not -n <= i < n:
            raise IndexError(f"record index {i} out of range for a batch of {n}")
        i %= n
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.data[start:end].numpy().tobytes()

    def tolist(self) -> List[bytes]:
        """Every record as bytes (one Python object each: for small batches
        and tests)."""
        raw = self.data.numpy().tobytes()
        offs = self.offsets.tolist()
        return [raw[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]

    @classmethod
    def from_records(cls, records: Sequence[bytes]) -> RecordBatch:
        """Pack a sequence of bytes into one batch (one copy)."""
        records = [bytes(r) for r in records]
        sizes = torch.tensor([0] + [len(r) for r in records], dtype=torch.int64)
        joined = b"".join(records)
        data = (
            torch.frombuffer(bytearray(joined), dtype=torch.uint8)
            if joined
            else torch.empty(0, dtype=torch.uint8)
        )
        return cls(data, torch.cumsum(sizes, 0))


def _as_records(records):
    if isinstance(records, tuple) and len(records) == 2 and isinstance(records[0], torch.Tensor):
        data, offsets = records
        if not isinstance(offsets, torch.Tensor):
            raise TypeError("a (data, offsets) batch needs two tensors")
        return (data, offsets)
    if isinstance(records, (list, tuple)):
        return records if isinstance(records, list) else list(records)
    raise TypeError(
        "records must be a RecordBatch, a (data, offsets) pair of tensors or a list of bytes, "
        f"got {type(records).__name__}"
    )


# --------------------------------------------------------------- files


def read_records(
    path_or_pattern: Union[PathLike, Sequence[PathLike]],
    compression: Optional[str] = None,
    *,
    batch_size: Optional[int] = None,
) -> Iterator[Union[bytes, RecordBatch]]:
    """Read the records of TFRecord files, in file order.

    Args:
        path_or_pattern: a path, a glob pattern (``*``, ``?``, ``[...]``) or a
            list of them; matched files are read in sorted order.
        compression: None / ``""``, ``"GZIP"`` or ``"ZLIB"``.
        batch_size: if given, yield :class:`RecordBatch` objects of up to this
            many records (read with the GIL released, no per-record Python
            objects) instead of one ``bytes`` per record. Batches do not span
            files.

    Raises:
        RecordFileError: no file matches (raised by this call, before
            iterating), or a file cannot be read.
        CorruptRecordError: a truncated file or a CRC mismatch, naming the
            file, the byte offset and the record index.
    """
    patterns = _patterns(path_or_pattern)
    compression = _check_compression(compression)
    if batch_size is not None:
        check_int("batch_size", batch_size, 1, ">= 1")
    files = _C._match_files(patterns)
    return _read(files, compression, batch_size)


def _read(files: List[str], compression, batch_size) -> Iterator:
    for path in files:
        reader = _C._RecordFileReader(path, compression)
        if batch_size is None:
            while True:
                record = reader.read()
                if record is None:
                    break
                yield record
        else:
            while True:
                data, offsets = reader.read_batch(batch_size)
                if offsets.numel() == 1:
                    break
                yield RecordBatch(data, offsets)


class RecordWriter:
    """Write records to a TFRecord file (created or truncated).

    Use as a context manager, or call :meth:`close`; records are buffered
    until then (or :meth:`flush`).

    Args:
        path: the file to write.
        compression: None / ``""``, ``"GZIP"`` or ``"ZLIB"``.

    Example::

        with torch_stage.RecordWriter("data.tfrecord") as w:
            w.write(torch_stage.encode_example({"x": 1.0}))
    """

    def __init__(self, path: PathLike, compression: Optional[str] = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be str or os.PathLike, got {type(path).__name__}")
        self._compression = _check_compression(compression)
        self._writer = _C._RecordFileWriter(_check_path(os.fspath(path), "path"), self._compression)

    @property
    def path(self) -> str:
        return self._writer.path

    @property
    def records_written(self) -> int:
        return self._writer.records_written

    def write(self, record) -> None:
        """Append one record: bytes-like, or a 1-D uint8 tensor."""
        if isinstance(record, torch.Tensor):
            if record.dtype != torch.uint8 or record.dim() != 1:
                raise TypeError(
                    f"a tensor record must be 1-D uint8, got {record.dtype} {tuple(record.shape)}"
                )
            record = record.contiguous().numpy()
        elif not isinstance(record, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"a record must be bytes-like or a uint8 tensor, got {type(record).__name__}"
            )
        self._writer.write(record)

    def write_batch(self, records: Union[RecordBatch, Sequence[bytes]]) -> None:
        """Append every record of a :class:`RecordBatch` (GIL released) or a
        sequence of bytes."""
        records = _as_records(records)
        if isinstance(records, tuple):
            self._writer.write_batch(records[0], records[1])
        else:
            for r in records:
                self.write(r)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        """Finish the file (and its compressed stream). Idempotent."""
        self._writer.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()
