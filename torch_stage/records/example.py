"""``tf.train.Example`` in C++: feature specs, :func:`parse_example` (a
whole batch into tensors, GIL released) and :func:`encode_example`.

No TensorFlow or protobuf is needed: the Example wire format is implemented
in ``csrc/records/example.cpp``.
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from torch_stage import _C
from torch_stage._checks import INT64_MAX, is_int
from torch_stage.records.record_io import RecordBatch, _as_records

__all__ = ["FixedLenFeature", "Ragged", "VarLenFeature", "encode_example", "parse_example"]

# Feature kinds as the C++ side numbers them (csrc/records/example.h).
_BYTES, _FLOAT, _INT64 = 1, 2, 3
_KINDS = {torch.uint8: _BYTES, torch.float32: _FLOAT, torch.int64: _INT64}
_DTYPE_NAMES = "torch.int64, torch.float32 or torch.uint8 (bytes)"


def _accelerator_available() -> bool:
    # Pinned host memory needs an accelerator's host allocator; without one
    # pinning is skipped (a CPU-only run must work unchanged).
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


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
