"""TFRecord files and ``tf.train.Example`` in C++: reading, writing, parsing
whole batches into tensors, and :class:`RecordInput`, a shuffled, threaded
reader in the manner of TensorFlow's ``RecordInput``.

No TensorFlow or protobuf is needed: the framing, CRC32C, GZIP/ZLIB and the
Example wire format are implemented in ``csrc/records`` (plain C++ + zlib).
Heavy work runs with the GIL released.

A batch of serialized records travels as a :class:`RecordBatch`: one flat
``uint8`` tensor and ``int64`` offsets, not one Python ``bytes`` per record.
"""

from __future__ import annotations

import numbers
import operator
import os
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from torch_stage import _C
from torch_stage._checks import INT64_MAX, MAX_WAIT_MS, check_int, is_int

__all__ = [
    "FixedLenFeature",
    "Ragged",
    "RecordBatch",
    "RecordDataset",
    "RecordInput",
    "RecordWriter",
    "VarLenFeature",
    "encode_example",
    "parse_example",
    "read_records",
]

PathLike = Union[str, "os.PathLike[str]"]

# Feature kinds as the C++ side numbers them (csrc/records/example.h).
_BYTES, _FLOAT, _INT64 = 1, 2, 3
_KINDS = {torch.uint8: _BYTES, torch.float32: _FLOAT, torch.int64: _INT64}
_DTYPE_NAMES = "torch.int64, torch.float32 or torch.uint8 (bytes)"


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


def _accelerator_available() -> bool:
    # Pinned host memory needs an accelerator's host allocator; without one
    # pinning is skipped (a CPU-only run must work unchanged).
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


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


class Ragged(NamedTuple):
    """A variable-length feature of a batch.

    Record ``i`` holds elements ``offsets[i]:offsets[i + 1]``. For int64 and
    float features an element is a value of ``values``. For bytes features an
    element is a byte string: string ``j`` is
    ``values[value_offsets[j]:value_offsets[j + 1]]`` (``value_offsets`` is
    None for numeric features).
    """

    values: torch.Tensor
    offsets: torch.Tensor
    value_offsets: Optional[torch.Tensor] = None

    def row(self, i: int):
        """Record ``i``'s elements: a tensor, or a list of bytes."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self.value_offsets is None:
            return self.values[start:end]
        vo = self.value_offsets
        return [
            self.values[int(vo[j]) : int(vo[j + 1])].numpy().tobytes() for j in range(start, end)
        ]


# ------------------------------------------------------------ feature specs


def _check_dtype(dtype) -> int:
    if dtype not in _KINDS:
        raise TypeError(f"dtype must be {_DTYPE_NAMES}, got {dtype!r}")
    return _KINDS[dtype]


def _check_shape(shape) -> List[int]:
    if is_int(shape):
        shape = [shape]
    if not isinstance(shape, (list, tuple, torch.Size)):
        raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    out = []
    for d in shape:
        if not is_int(d) or d < 0:
            raise ValueError(f"shape dimensions must be ints >= 0, got {list(shape)!r}")
        out.append(operator.index(d))
    count = 1
    for d in out:
        count *= d
    if count > INT64_MAX:
        raise ValueError(
            f"shape {tuple(out)} has {count} elements per record, more than a tensor "
            f"holds ({INT64_MAX})"
        )
    return out


def _numbers(value, kind: int, what: str) -> List:
    flat = _flat_numbers(value, what)
    if kind == _INT64:
        _check_int64s(flat, f"{what} of an int64 feature")
    return flat


def _check_int64s(values: List, what: str) -> None:
    """An Int64List's values: ints within int64 (bools count as 0 and 1)."""
    for v in values:
        if not isinstance(v, int):
            raise TypeError(f"{what} must be ints, got {v!r}")
        if not -INT64_MAX - 1 <= v <= INT64_MAX:
            raise ValueError(f"{what} must fit in int64, got {v}")


def _flat_numbers(value, what: str) -> List:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if is_int(value):
        return [operator.index(value)]
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return [float(value)]
    if isinstance(value, (list, tuple)):
        flat: List = []
        for v in value:
            flat.extend(_flat_numbers(v, what))
        return flat
    raise TypeError(f"{what} must be numbers, got {value!r}")


def _bytes_list(value, what: str) -> List[bytes]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [bytes(value)]
    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
        return [value.contiguous().numpy().tobytes()]
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, (bytes, bytearray, memoryview)) for v in value
    ):
        return [bytes(v) for v in value]
    raise TypeError(f"{what} must be bytes or a list of bytes, got {value!r}")


def _cached_spec(feature, key: str):
    cache = feature.__dict__.setdefault("_spec_cache", {})
    spec = cache.get(key)
    if spec is None:
        spec = cache[key] = feature._spec(key)
    return spec


class FixedLenFeature:
    """A feature with the same number of values in every record, parsed into
    one ``(N, *shape)`` tensor.

    Args:
        shape: per-record shape (``()`` for a scalar). For bytes features the
            record's byte strings, concatenated, must hold exactly
            ``prod(shape)`` bytes: ``FixedLenFeature((194,), torch.uint8)``
            reads one 194-byte string as a ``(N, 194)`` uint8 tensor.
        dtype: ``torch.int64`` (Int64List), ``torch.float32`` (FloatList) or
            ``torch.uint8`` (BytesList).
        default_value: used for records that lack the key, or whose
            Feature holds no list (``tf.train.Feature()``, which TensorFlow
            also reads as missing); without it a missing key is a
            :class:`~torch_stage.FeatureError`. A number
            (repeated over the shape), ``prod(shape)`` numbers, or for bytes
            ``prod(shape)`` bytes.
    """

    def __init__(self, shape, dtype, default_value=None):
        self.shape = _check_shape(shape)
        self.dtype = dtype
        self._kind = _check_dtype(dtype)
        count = 1
        for d in self.shape:
            count *= d
        self._count = count
        self.default_value = default_value
        self._default = None
        if default_value is not None:
            if self._kind == _BYTES:
                self._default = _bytes_list(default_value, "default_value")
                size = sum(len(b) for b in self._default)
            else:
                self._default = _numbers(default_value, self._kind, "default_value")
                if len(self._default) == 1 and count != 1:
                    self._default = self._default * count
                size = len(self._default)
            if size != count:
                unit = "bytes" if self._kind == _BYTES else "values"
                raise ValueError(
                    f"default_value holds {size} {unit}, the shape {tuple(self.shape)} "
                    f"needs {count}"
                )

    def _spec(self, key: str):
        return (key, self._kind, False, self.shape, self._default)

    def _spec_for(self, key: str):
        # Built once per key: parse_example runs once per batch, and fresh
        # tuples and lists each time are garbage-collector work.
        return _cached_spec(self, key)

    def __repr__(self) -> str:
        return (
            f"FixedLenFeature(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"default_value={self.default_value!r})"
        )


class VarLenFeature:
    """A feature with any number of values per record, parsed into a
    :class:`Ragged` (flat values + offsets).

    Args:
        dtype: ``torch.int64``, ``torch.float32`` or ``torch.uint8`` (bytes).
        default_value: the values for records that lack the key (a list of
            numbers, or of bytes); without it a missing key is a
            :class:`~torch_stage.FeatureError`. TensorFlow's VarLenFeature
            treats a missing key as empty; pass ``default_value=[]`` for that.
            A key that is there with an empty ``Feature()`` (no list) is an
            empty row, as in TensorFlow, not the default: unlike a fixed
            length, zero values is a row a variable length can hold.
    """

    def __init__(self, dtype, default_value=None):
        self.dtype = dtype
        self._kind = _check_dtype(dtype)
        self.default_value = default_value
        self._default = None
        if default_value is not None:
            if self._kind == _BYTES:
                self._default = (
                    []
                    if isinstance(default_value, (list, tuple)) and not default_value
                    else _bytes_list(default_value, "default_value")
                )
            else:
                self._default = _numbers(default_value, self._kind, "default_value")

    def _spec(self, key: str):
        return (key, self._kind, True, [], self._default)

    def _spec_for(self, key: str):
        return _cached_spec(self, key)

    def __repr__(self) -> str:
        return f"VarLenFeature(dtype={self.dtype}, default_value={self.default_value!r})"


# --------------------------------------------------------------- parsing


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


def parse_example(
    records: Union[RecordBatch, Sequence[bytes]],
    features: Mapping[str, Union[FixedLenFeature, VarLenFeature]],
    *,
    pin_memory: bool = False,
) -> Dict[str, Union[torch.Tensor, Ragged]]:
    """Parse a whole batch of serialized ``tf.train.Example`` in C++.

    The GIL is released while parsing. Records are decoded on torch's
    intra-op threads (``torch.set_num_threads``), each straight into its slot
    of outputs allocated once for the batch: there is no per-record tensor and
    no collate step.

    Args:
        records: a :class:`RecordBatch` (or a ``(data, offsets)`` pair of
            tensors), or a list of ``bytes``.
        features: feature key -> :class:`FixedLenFeature` or
            :class:`VarLenFeature`.
        pin_memory: allocate the outputs in pinned host memory, for a fast
            non-blocking copy to the GPU. Without an accelerator, pinning is
            skipped and the outputs are ordinary CPU tensors.

    Returns:
        key -> ``(N, *shape)`` tensor (fixed-length) or :class:`Ragged`
        (variable-length). Bytes features are ``uint8`` tensors.

    Raises:
        FeatureError: a record lacks a key that has no default, or holds the
            wrong list type or number of values; names the key and the record
            index (the lowest failing one).
        ExampleParseError: a record is not a serialized Example.
        ValueError / TypeError: bad arguments, before any parsing.
    """
    plan = _plan_for(features)
    pin = bool(pin_memory) and _accelerator_available()
    return _C._parse_example(_as_records(records), plan, pin)


# Parse plans by feature mapping: (key, id(feature)) pairs -> (plan, the
# features). Holding the features keeps their ids from being reused while
# their plan is here. A training loop parses every batch with one mapping:
# its plan is made once, and each call converts nothing but its records.
_PLANS: Dict[tuple, tuple] = {}
_MAX_PLANS = 256


def _plan_for(features):
    if not isinstance(features, Mapping) or not features:
        raise TypeError(
            "features must be a non-empty mapping of key -> FixedLenFeature/VarLenFeature"
        )
    key = tuple([(k, id(f)) for k, f in features.items()])
    cached = _PLANS.get(key)
    if cached is not None:
        return cached[0]
    specs = []
    for k, spec in features.items():
        if not isinstance(k, str):
            raise TypeError(f"feature keys must be str, got {k!r}")
        if not isinstance(spec, (FixedLenFeature, VarLenFeature)):
            raise TypeError(
                f"feature '{k}' must be a FixedLenFeature or VarLenFeature, got {spec!r}"
            )
        specs.append(spec._spec_for(k))
    plan = _C._ParsePlan(specs, Ragged)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = (plan, tuple(features.values()))
    return plan


def encode_example(features: Mapping[str, Any]) -> bytes:
    """Serialize a ``tf.train.Example`` (for writing files and tests).

    Values: ``bytes`` (or a list of bytes, a ``str`` as UTF-8, a uint8
    tensor) -> BytesList; ``int`` or a list of ints, an integer tensor ->
    Int64List; ``float`` or a list of numbers with a float, a floating tensor
    -> FloatList. A ``(values, dtype)`` pair states the list type
    (``torch.int64``, ``torch.float32``, ``torch.uint8`` for bytes), which an
    empty list needs: ``{"ids": ([], torch.int64)}``.
    """
    if not isinstance(features, Mapping):
        raise TypeError(
            f"features must be a mapping of key -> values, got {type(features).__name__}"
        )
    items = []
    for key, value in features.items():
        if not isinstance(key, str):
            raise TypeError(f"feature keys must be str, got {key!r}")
        kind, values = _encode_value(key, value)
        if kind == _INT64:
            _check_int64s(values, f"feature '{key}': an Int64List's values")
        items.append((key, kind, values))
    return _C._encode_example(items)


def _encode_value(key: str, value):
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[1], torch.dtype)
        and isinstance(value[0], (list, tuple))
    ):
        values, dtype = value
        kind = _KINDS.get(dtype)
        if kind is None:
            raise TypeError(f"feature '{key}': dtype must be {_DTYPE_NAMES}, got {dtype}")
        if kind == _BYTES:
            return kind, [v.encode() if isinstance(v, str) else bytes(v) for v in values]
        return kind, [int(v) if kind == _INT64 else float(v) for v in values]
    if isinstance(value, str):
        return _BYTES, [value.encode()]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _BYTES, [bytes(value)]
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.uint8:
            return _BYTES, [value.contiguous().numpy().tobytes()]
        if value.dtype.is_floating_point:
            return _FLOAT, value.reshape(-1).tolist()
        if value.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.bool):
            return _INT64, value.reshape(-1).to(torch.int64).tolist()
        raise TypeError(f"feature '{key}': cannot encode a {value.dtype} tensor")
    if isinstance(value, bool) or is_int(value):
        return _INT64, [int(value)]
    if isinstance(value, numbers.Real):  # numpy's floats too
        return _FLOAT, [float(value)]
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(
                f"feature '{key}': an empty list has no type; give it one as "
                "([], torch.int64), ([], torch.float32) or ([], torch.uint8) for bytes"
            )
        if all(isinstance(v, (bytes, bytearray, memoryview, str)) for v in value):
            return _BYTES, [v.encode() if isinstance(v, str) else bytes(v) for v in value]
        if all(isinstance(v, bool) or is_int(v) for v in value):
            return _INT64, [int(v) for v in value]
        if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
            return _FLOAT, [float(v) for v in value]
    raise TypeError(
        f"feature '{key}': cannot encode {value!r}; use bytes, numbers, lists of them or tensors"
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


# ------------------------------------------------------------ RecordInput


class RecordInput:
    """Shuffled batches of serialized records from TFRecord files, read by
    background C++ threads (TensorFlow's ``RecordInput``).

    ``parallelism`` threads read files concurrently into a shuffle pool of
    ``buffer_size`` records; batches flow once the pool is half full, and the
    pool keeps filling to full. Records are drawn uniformly from the pool.
    With a fixed ``seed`` the batches and their order are the same every run,
    whatever the threads do (the mixer takes records from the readers in a
    fixed round-robin; see ``csrc/records/record_input.h``).

    Iteration protocol (what ``staged()`` and ``DataLoader`` wrappers rely
    on): a RecordInput is its own iterator (``iter(ri) is ri``), so it is
    consumed once. ``next(ri)`` blocks, with the GIL released, until a
    :class:`RecordBatch` is ready; the threads start on the first call (or
    :meth:`start`). It raises ``StopIteration`` once ``epochs`` passes are
    delivered (the last batch may be short), and after :meth:`close`. A bad
    file raises its :class:`~torch_stage.RecordError` subclass at the
    position where its records would have come; calling ``next`` again goes
    on with the rest of the data (the bad file's remaining records are
    skipped), so a stage may skip and count such errors. Several threads may
    call ``next`` at once; each batch goes to one of them.

    Files without records: an empty file is a valid file of no records and
    adds nothing. A pass over the files that yields no record at all (every
    file empty, unreadable, deleted, or failing before its first complete
    record, whose errors come first) ends the data, because the next pass
    would find nothing again: with a finite ``epochs`` cleanly
    (``StopIteration``, as an empty dataset; the remaining passes are not
    spun through), with ``epochs=None`` by raising a
    :class:`~torch_stage.RecordFileError` naming the files, then
    ``StopIteration``: repeating forever over files without a record could
    never give an item, and a quiet end would hide the mistake. A file cut
    short while being read (truncated or rewritten in place) raises
    :class:`~torch_stage.RecordFileError` ("shrank while being read")
    rather than ending early; one deleted raises it ("cannot open") when a
    later pass reaches it.

    Args:
        file_pattern: a path, glob pattern, or list of them.
        parallelism: reader threads (at most one per file).
        buffer_size: records in the shuffle pool.
        batch_size: records per batch.
        seed: seed of the file order and the pool's draws; None for a
            random seed (and a different order every run).
        shift_ratio: in [0, 1): each epoch's shuffled file list is rotated by
            ``shift_ratio * files``, so workers sharing files start apart.
        compression: None / ``""``, ``"GZIP"`` or ``"ZLIB"``.
        shard: ``(rank, world_size)``: this reader gets the sorted files
            ``[rank::world_size]`` (sharding is by file).
        epochs: passes over the files, or None to repeat forever (as
            TensorFlow's RecordInput does).
        prefetch_batches: finished batches that may wait for the consumer.

    Raises (at construction, before any thread starts):
        RecordFileError: no file matches the pattern.
        ValueError / TypeError: a bad argument, naming it and the rule.
    """

    def __init__(
        self,
        file_pattern: Union[PathLike, Sequence[PathLike]],
        parallelism: int = 16,
        buffer_size: int = 10000,
        batch_size: int = 32,
        seed: Optional[int] = 301,
        shift_ratio: float = 0.0,
        compression: Optional[str] = None,
        shard=(0, 1),
        epochs: Optional[int] = None,
        *,
        prefetch_batches: int = 2,
    ):
        self._handle = None
        patterns = _patterns(file_pattern, "file_pattern")
        check_int("parallelism", parallelism, 1, ">= 1")
        check_int("buffer_size", buffer_size, 1, ">= 1")
        check_int("batch_size", batch_size, 1, ">= 1")
        check_int("prefetch_batches", prefetch_batches, 1, ">= 1")
        if seed is not None:
            check_int("seed", seed, 0, ">= 0 (or None for a random seed)", 2**64 - 1)
        if isinstance(shift_ratio, bool) or not isinstance(shift_ratio, (int, float)):
            raise TypeError(f"shift_ratio must be a float, got {shift_ratio!r}")
        if not 0.0 <= shift_ratio < 1.0:
            raise ValueError(f"shift_ratio must be in [0, 1), got {shift_ratio}")
        compression = _check_compression(compression)
        if (
            not isinstance(shard, (tuple, list))
            or len(shard) != 2
            or not all(is_int(v) for v in shard)
        ):
            raise TypeError(f"shard must be a (rank, world_size) pair of ints, got {shard!r}")
        rank, world = (operator.index(v) for v in shard)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"shard must be (rank, world_size) with world_size >= 1 and "
                f"0 <= rank < world_size, got {tuple(shard)}"
            )
        if epochs is not None:
            check_int("epochs", epochs, 1, ">= 1 (or None to repeat forever)")
        self.batch_size = batch_size
        self.epochs = epochs
        self._handle = _C._RecordInput(
            patterns,
            parallelism,
            buffer_size,
            batch_size,
            seed,
            float(shift_ratio),
            compression,
            rank,
            world,
            -1 if epochs is None else epochs,
            prefetch_batches,
        )

    @property
    def files(self) -> List[str]:
        """The files this reader reads (its shard), sorted."""
        return list(self._handle.files)

    def start(self) -> None:
        """Start the threads now rather than on the first ``next()``."""
        self._handle.start()

    def __iter__(self) -> RecordInput:
        return self

    def __next__(self) -> RecordBatch:
        return RecordBatch(*self._handle.take(-1))

    def next_batch(self, timeout: Optional[float] = None) -> Optional[RecordBatch]:
        """As ``next()``, but return None if no batch came within ``timeout``
        seconds (None waits without bound; 0 only tries)."""
        if timeout is None:
            return next(self)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError(f"timeout must be a number >= 0 or None, got {timeout!r}")
        # inf and other waits beyond the C++ side's reach: as long as it can.
        got = self._handle.take(int(min(timeout * 1000, MAX_WAIT_MS)))
        return None if got is None else RecordBatch(*got)

    def close(self) -> None:
        """Stop and join the threads; waiting ``next()`` calls raise
        StopIteration. Idempotent."""
        if self._handle is not None:
            self._handle.close()

    def stats(self) -> dict:
        """``files``, ``readers``, ``records_read``, ``records_out``,
        ``batches_out``, ``errors``, ``pool_size``, ``epoch``,
        ``buffer_bytes`` (the file blocks the pool's records lie in, as of
        the last batch: the pool's memory), ``records_compacted`` (records
        moved to free a nearly empty block), ``started``, ``closed``."""
        return self._handle.stats()

    def __enter__(self) -> RecordInput:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __del__(self):
        # Garbage collection stops the threads too (close() joins them; they
        # never need the GIL, so this cannot deadlock).
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()

    def __repr__(self) -> str:
        if self._handle is None:
            return "RecordInput(<not constructed>)"
        s = self._handle.stats()
        return (
            f"RecordInput(files={s['files']}, readers={s['readers']}, "
            f"batch_size={self.batch_size}, epochs={self.epochs}, closed={s['closed']})"
        )


class RecordDataset(torch.utils.data.IterableDataset):
    """TFRecord batches as an ``IterableDataset``, for ``torch_stage.DataLoader``
    (or ``torch.utils.data.DataLoader``) with ``batch_size=None``.

    Each iteration makes its own :class:`RecordInput`, in the process that
    iterates (reader threads do not survive a fork into DataLoader workers).
    With ``num_workers > 0``, worker ``w`` of ``W`` reads file shard
    ``rank * W + w`` of ``world_size * W``, so every file is read by exactly
    one worker of one rank: there must be at least that many files.

    Args:
        file_pattern: as for :class:`RecordInput`.
        **kwargs: the other :class:`RecordInput` arguments (``epochs``
            defaults to 1 here: one pass per DataLoader epoch).

    Example::

        loader = torch_stage.DataLoader(
            torch_stage.RecordDataset("train-*.tfrecord", batch_size=256),
            batch_size=None, num_workers=2,
            transform=lambda batch: torch_stage.parse_example(batch, features),
            device="cuda")
    """

    def __init__(self, file_pattern, **kwargs):
        kwargs.setdefault("epochs", 1)
        self.file_pattern = file_pattern
        self.kwargs = kwargs
        # Check the arguments and the files now (no thread starts until a
        # RecordInput is iterated).
        RecordInput(file_pattern, **kwargs).close()

    def __iter__(self) -> RecordInput:
        rank, world = self.kwargs.get("shard", (0, 1))
        info = torch.utils.data.get_worker_info()
        if info is not None:
            rank, world = rank * info.num_workers + info.id, world * info.num_workers
        kwargs = dict(self.kwargs, shard=(rank, world))
        return RecordInput(self.file_pattern, **kwargs)
