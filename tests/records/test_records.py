"""torch_stage.records: TFRecord files, Example encoding/parsing, RecordInput.

Interoperability with the PyPI `tfrecord` package is in test_records_interop.py
and the fuzz tests in test_records_fuzz.py.
"""

import itertools
import os
import random
import threading
import time

import numpy as np
import pytest
import torch
from conftest import HANG_BOUND_S, devices

import torch_stage
from torch_stage import (
    CorruptRecordError,
    ExampleParseError,
    FeatureError,
    FixedLenFeature,
    Ragged,
    RecordBatch,
    RecordError,
    RecordFileError,
    RecordInput,
    RecordWriter,
    VarLenFeature,
    encode_example,
    parse_example,
    read_records,
)

COMPRESSIONS = [None, "GZIP", "ZLIB"]


def write(path, records, compression=None):
    with RecordWriter(path, compression) as w:
        for r in records:
            w.write(r)
    return path


def example(i):
    return encode_example(
        {
            "d": bytes([i % 256]) * 4,
            "s": i * 10 - 3,
            "v": ([0.5 * i] * (i % 3), torch.float32),
            "t": [b"x" * i, b"y"],
        }
    )


SPECS = {
    "d": FixedLenFeature((4,), torch.uint8),
    "s": FixedLenFeature((), torch.int64),
    "v": VarLenFeature(torch.float32),
    "t": VarLenFeature(torch.uint8),
}


def files(tmp_path, n_files, per_file, compression=None):
    for k in range(n_files):
        write(
            tmp_path / f"f{k}.rec",
            [f"f{k}r{i}".encode() for i in range(per_file)],
            compression,
        )
    return str(tmp_path / "*.rec")


# ------------------------------------------------------------------ files


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_write_then_read_round_trips(tmp_path, compression):
    records = [b"", b"hello", bytes(range(256)) * 40] + [bytes([i]) * i for i in range(50)]
    path = write(tmp_path / "a.tfrecord", records, compression)
    assert list(read_records(path, compression)) == records
    batches = list(read_records(path, compression, batch_size=7))
    assert [b.num_records for b in batches] == [7] * 7 + [4]
    assert list(itertools.chain.from_iterable(b.tolist() for b in batches)) == records
    assert batches[0].record(1) == b"hello"
    assert batches[0].record(-7) == b""


def test_the_framing_is_tensorflows(tmp_path):
    # length (LE uint64), masked CRC32C of it, data, masked CRC32C of data;
    # the CRCs made by the `crc32c` package (see test_records_interop.py).
    path = write(tmp_path / "a", [b"hello"])
    assert path.read_bytes() == bytes.fromhex("0500000000000000eab2043e68656c6c6fbb1f1c19")


def test_read_records_sorts_files_and_takes_lists_of_patterns(tmp_path):
    for name in ["b.rec", "a.rec", "c.rec"]:
        write(tmp_path / name, [name.encode()])
    got = list(read_records([str(tmp_path / "[bc].rec"), tmp_path / "a.rec"]))
    assert got == [b"a.rec", b"b.rec", b"c.rec"]


def test_no_matching_file_raises_at_the_call(tmp_path):
    pattern = str(tmp_path / "*.none")
    with pytest.raises(RecordFileError, match="no file matches the pattern") as info:
        read_records(pattern)  # not deferred to the first next()
    assert info.value.path == pattern
    assert isinstance(info.value, OSError) and isinstance(info.value, RecordError)


def test_truncated_file_names_file_offset_and_index(tmp_path):
    path = write(tmp_path / "t", [b"hello", b"world"])
    path.write_bytes(path.read_bytes()[:-3])
    it = read_records(str(path))
    assert next(it) == b"hello"
    with pytest.raises(CorruptRecordError, match="truncated record 1 at byte offset 21") as info:
        next(it)
    e = info.value
    assert (e.path, e.offset, e.record_index) == (str(path), 21, 1)
    assert "4-byte data CRC" in str(e)


@pytest.mark.parametrize(
    "flip, text",
    [(9, "length CRC mismatch"), (13, "data CRC mismatch")],
)
def test_bad_crcs(tmp_path, flip, text):
    path = write(tmp_path / "c", [b"hello"])
    raw = bytearray(path.read_bytes())
    raw[flip] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError, match=text) as info:
        list(read_records(str(path)))
    assert info.value.record_index == 0 and info.value.offset == 0


def test_bad_compressed_stream(tmp_path):
    path = write(tmp_path / "g", [b"x" * 1000] * 20, "GZIP")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CorruptRecordError, match="GZIP") as info:
        list(read_records(str(path), "GZIP"))
    assert info.value.path == str(path)
    plain = write(tmp_path / "p", [b"abc"])
    with pytest.raises(CorruptRecordError):
        list(read_records(str(plain), "ZLIB"))


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_a_compressed_file_read_as_plain_says_which_compression_to_pass(tmp_path, compression):
    path = write(tmp_path / "z", [b"hello"] * 3, compression)
    with pytest.raises(CorruptRecordError, match=f'compression="{compression}"'):
        list(read_records(str(path)))
    # A plain file whose first CRC is wrong gets no such hint.
    plain = write(tmp_path / "p", [b"hello"])
    raw = bytearray(plain.read_bytes())
    raw[9] ^= 1
    plain.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError) as info:
        list(read_records(str(plain)))
    assert "compression=" not in str(info.value)
    # And the other way round: a plain file read as a compressed one.
    with pytest.raises(CorruptRecordError, match="read with compression=None"):
        list(read_records(str(write(tmp_path / "q", [b"hello"])), compression))


def test_writer_api(tmp_path):
    path = tmp_path / "w"
    w = RecordWriter(path)
    w.write(b"a")
    w.write(bytearray(b"bc"))
    w.write(torch.tensor([100, 101], dtype=torch.uint8))
    w.write_batch(RecordBatch.from_records([b"x", b"", b"yz"]))
    w.write_batch([b"q"])
    w.flush()
    assert list(read_records(str(path))) == [b"a", b"bc", b"de", b"x", b"", b"yz", b"q"]
    assert w.records_written == 7 and w.path == str(path)
    w.close()
    w.close()  # idempotent
    with pytest.raises(RecordFileError, match="closed"):
        w.write(b"late")
    with pytest.raises(TypeError, match="bytes-like"):
        RecordWriter(tmp_path / "x").write("text")
    with pytest.raises(TypeError, match="1-D uint8"):
        RecordWriter(tmp_path / "x").write(torch.zeros(2))
    with pytest.raises(ValueError, match='compression must be None, "", "GZIP" or "ZLIB"'):
        RecordWriter(tmp_path / "x", "zstd")
    with pytest.raises(RecordFileError, match="cannot create"):
        RecordWriter(tmp_path / "no" / "dir" / "x")


def test_record_batch_from_records_and_back():
    batch = RecordBatch.from_records([b"ab", b"", b"c"])
    assert batch.num_records == 3
    assert batch.offsets.tolist() == [0, 2, 2, 3]
    assert batch.data.dtype == torch.uint8
    assert batch.tolist() == [b"ab", b"", b"c"]
    with pytest.raises(IndexError):
        batch.record(3)
    empty = RecordBatch.from_records([])
    assert empty.num_records == 0 and empty.tolist() == []


# --------------------------------------------------------------- examples


def test_encode_example_matches_protobuf_bytes():
    # Serialized by protobuf (vectors shared with tests/cpp/test_example.cpp).
    assert encode_example({"b": [b"ab", b""]}) == bytes.fromhex(
        "0a0f0a0d0a016212080a060a0261620a00"
    )
    assert encode_example({"f": [1.5, -2.0]}) == bytes.fromhex(
        "0a130a110a0166120c120a0a080000c03f000000c0"
    )
    assert encode_example({"i": [1, -1, 300]}) == bytes.fromhex(
        "0a180a160a016912111a0f0a0d01ffffffffffffffffff01ac02"
    )


def test_encode_example_value_types():
    out = parse_example(
        [
            encode_example(
                {
                    "s": "héllo",
                    "u": torch.tensor([1, 2, 3], dtype=torch.uint8),
                    "i": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
                    "f": torch.tensor([0.25], dtype=torch.float64),
                    "m": [1, 2.5],
                    "e": ([], torch.int64),
                    "b": True,
                }
            )
        ],
        {
            "s": VarLenFeature(torch.uint8),
            "u": FixedLenFeature(3, torch.uint8),
            "i": FixedLenFeature((2, 2), torch.int64),
            "f": FixedLenFeature((), torch.float32),
            "m": FixedLenFeature(2, torch.float32),
            "e": VarLenFeature(torch.int64),
            "b": FixedLenFeature((), torch.int64),
        },
    )
    assert out["s"].row(0) == ["héllo".encode()]
    assert out["u"].tolist() == [[1, 2, 3]]
    assert out["i"].tolist() == [[[1, 2], [3, 4]]]
    assert out["f"].tolist() == [0.25]
    assert out["m"].tolist() == [[1.0, 2.5]]
    assert out["e"].values.numel() == 0 and out["e"].offsets.tolist() == [0, 0]
    assert out["b"].tolist() == [1]


@pytest.mark.parametrize(
    "value, error, text",
    [
        ([], ValueError, "an empty list has no type"),
        ([1, b"x"], TypeError, "cannot encode"),
        (None, TypeError, "cannot encode"),
        (torch.zeros(2, dtype=torch.complex64), TypeError, "cannot encode a torch.complex64"),
        (([1], torch.int16), TypeError, "dtype must be"),
    ],
)
def test_encode_example_rejects_untyped_values(value, error, text):
    with pytest.raises(error, match=text):
        encode_example({"k": value})


@pytest.mark.parametrize("as_batch", [False, True], ids=["bytes_list", "record_batch"])
def test_parse_example_fixed_and_var_len(as_batch):
    records = [example(i) for i in range(37)]
    out = parse_example(RecordBatch.from_records(records) if as_batch else records, SPECS)
    assert out["d"].shape == (37, 4) and out["d"].dtype == torch.uint8
    assert out["d"][:, 0].tolist() == list(range(37))
    assert out["s"].shape == (37,) and out["s"].tolist() == [i * 10 - 3 for i in range(37)]
    v = out["v"]
    assert isinstance(v, Ragged) and v.value_offsets is None
    assert (v.offsets[1:] - v.offsets[:-1]).tolist() == [i % 3 for i in range(37)]
    assert v.row(5).tolist() == [2.5, 2.5]
    t = out["t"]
    assert t.row(4) == [b"xxxx", b"y"]
    assert t.offsets[-1] == t.value_offsets.numel() - 1 == 74
    assert t.value_offsets[-1] == t.values.numel()


def test_parse_example_makes_a_mappings_plan_once_and_never_reuses_a_stale_one():
    from torch_stage.records import example as records_module

    records = [encode_example({"a": i, "b": [i, i + 1]}) for i in range(5)]
    features = {"a": FixedLenFeature((), torch.int64), "b": VarLenFeature(torch.int64)}
    records_module._PLANS.clear()
    for _ in range(3):
        assert parse_example(records, features)["a"].tolist() == [0, 1, 2, 3, 4]
    assert len(records_module._PLANS) == 1
    # The same keys with other features, in a new mapping and in the same
    # mapping changed: each parse follows the features it is given.
    other = {"a": FixedLenFeature((1,), torch.int64), "b": FixedLenFeature((2,), torch.int64)}
    assert parse_example(records, other)["b"].tolist() == [[i, i + 1] for i in range(5)]
    features["b"] = FixedLenFeature((2,), torch.int64)
    assert parse_example(records, features)["b"].shape == (5, 2)
    del features["b"]
    assert list(parse_example(records, features)) == ["a"]
    assert len(records_module._PLANS) == 4


def test_parse_example_uses_several_threads_with_the_same_result():
    records = [example(i) for i in range(3000)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = parse_example(records, SPECS)
        torch.set_num_threads(4)
        many = parse_example(records, SPECS)
    finally:
        torch.set_num_threads(old)
    for key in ("d", "s"):
        assert torch.equal(one[key], many[key])
    for key in ("v", "t"):
        assert torch.equal(one[key].values, many[key].values)
        assert torch.equal(one[key].offsets, many[key].offsets)


def test_keys_in_any_order_with_unknown_keys_between_and_repeats():
    # Entries are looked up by the order learnt from earlier records; later
    # records in other orders, with unknown keys between and a key given
    # twice (protobuf merges two Examples back to back: the last entry
    # wins), parse the same. Keys of one length that differ late ("C1",
    # "C2") and prefixes ("C1", "C10") must not be mistaken for each other.
    rng = random.Random(5)
    keys = ["C1", "C2", "C10", "C11", "C100", "label", "I1", "I13", "x"]
    records, want = [], []
    for i in range(600):
        values = {k: i * 100 + j - 50 for j, k in enumerate(keys)}
        order = list(keys)
        if i >= 300:
            rng.shuffle(order)
        ex = {}
        for k in order:
            if rng.random() < 0.25:
                ex[f"unknown{rng.randrange(4)}"] = [1.5]
            ex[k] = values[k]
        record = encode_example(ex)
        if i % 7 == 0:
            values["C10"] = -i
            record += encode_example({"C10": -i})
        records.append(record)
        want.append(values)
    specs = {k: FixedLenFeature((), torch.int64) for k in keys}
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = parse_example(records, specs)
            for k in keys:
                assert out[k].tolist() == [w[k] for w in want], k
    finally:
        torch.set_num_threads(old)


def test_fixed_length_numbers_of_the_wrong_count_are_errors_not_overruns():
    # Fixed-length numbers are decoded straight into their slot while
    # counted: a record with more values than the shape must fail naming
    # the count, and leave no value written into its neighbour's slot.
    specs = {"i": FixedLenFeature((2,), torch.int64), "f": FixedLenFeature((2,), torch.float32)}
    good = encode_example({"i": [1, 2], "f": [0.5, 1.5]})
    assert parse_example([good, good], specs)["i"].tolist() == [[1, 2], [1, 2]]
    for bad, key, count in [
        (encode_example({"i": [1, 2, 3], "f": [0.5, 1.5]}), "i", 3),
        (encode_example({"i": [7], "f": [0.5, 1.5]}), "i", 1),
        (encode_example({"i": [1, 2], "f": [0.5, 1.5, 2.5]}), "f", 3),
        (encode_example({"i": [1, 2], "f": ([], torch.float32)}), "f", 0),
    ]:
        with pytest.raises(FeatureError, match=f"'{key}' of record 1 holds {count} values") as info:
            parse_example([good, bad, good], specs)
        assert (info.value.key, info.value.record_index) == (key, 1)


def test_parse_example_empty_batch():
    out = parse_example([], SPECS)
    assert out["d"].shape == (0, 4) and out["s"].shape == (0,)
    assert out["v"].offsets.tolist() == [0] and out["t"].value_offsets.tolist() == [0]


def test_defaults_fill_missing_keys():
    rec = encode_example({"other": 1})
    out = parse_example(
        [rec, example(4)],
        {
            "d": FixedLenFeature((4,), torch.uint8, default_value=b"\x09" * 4),
            "s": FixedLenFeature((), torch.int64, default_value=-1),
            "m": FixedLenFeature((2, 2), torch.float32, default_value=0.5),
            "v": VarLenFeature(torch.float32, default_value=[]),
            "t": VarLenFeature(torch.uint8, default_value=[b"none"]),
        },
    )
    assert out["d"][0].tolist() == [9] * 4 and out["d"][1].tolist() == [4] * 4
    assert out["s"].tolist() == [-1, 37]
    assert out["m"].tolist() == [[[0.5, 0.5], [0.5, 0.5]]] * 2
    assert out["v"].row(0).numel() == 0 and out["v"].row(1).tolist() == [2.0]
    assert out["t"].row(0) == [b"none"] and out["t"].row(1) == [b"xxxx", b"y"]


def test_missing_key_names_key_and_record():
    records = [example(0), example(1), encode_example({"d": b"abcd"}), example(3)]
    with pytest.raises(FeatureError, match="record 2 has no feature 's'") as info:
        parse_example(records, SPECS)
    assert (info.value.key, info.value.record_index) == ("s", 2)


def empty_feature_example(key):
    """Example{features{feature{key: Feature{}}}}: a Feature with no list
    set, what TensorFlow writes for ``tf.train.Feature()``."""
    k = key.encode()
    entry = b"\x0a" + bytes([len(k)]) + k + b"\x12\x00"
    features = b"\x0a" + bytes([len(entry)]) + entry
    return b"\x0a" + bytes([len(features)]) + features


def test_an_empty_feature_counts_as_missing_for_fixed_length_as_in_tensorflow():
    # tf.io.parse_example skips an entry whose Feature holds no list: a
    # fixed-length feature takes its default there (or is missing without
    # one), a var-length one is empty. Bytes checked against TensorFlow
    # 2.21: FixedLenFeature((), tf.int64, default_value=7) gives [7], and
    # without a default "Feature: i (data type: int64) is required but
    # could not be found".
    rec = empty_feature_example("i")
    spec = {"i": FixedLenFeature((), torch.int64, default_value=7)}
    assert parse_example([rec, encode_example({"i": 3})], spec)["i"].tolist() == [7, 3]
    out = parse_example(
        [empty_feature_example("f")], {"f": FixedLenFeature((2,), torch.float32, default_value=0.5)}
    )
    assert out["f"].tolist() == [[0.5, 0.5]]
    for shape in ((), (0,)):
        with pytest.raises(FeatureError, match="record 0 has no feature 'i'") as info:
            parse_example([rec], {"i": FixedLenFeature(shape, torch.int64)})
        assert (info.value.key, info.value.record_index) == ("i", 0)
    var = parse_example([rec], {"i": VarLenFeature(torch.int64)})["i"]
    assert var.offsets.tolist() == [0, 0] and var.values.numel() == 0


def test_wrong_type_and_wrong_size():
    bad_type = encode_example({"d": b"abcd", "s": 1.0, "v": [1.0], "t": [b""]})
    with pytest.raises(FeatureError, match="'s' of record 1 is a FloatList, expected an Int64List"):
        parse_example([example(0), bad_type], SPECS)
    bad_size = encode_example({"d": b"abc", "s": 1, "v": [1.0], "t": [b""]})
    with pytest.raises(FeatureError, match="holds 3 bytes, expected exactly 4") as info:
        parse_example([bad_size], SPECS)
    assert info.value.key == "d" and info.value.record_index == 0


def test_not_an_example_names_the_lowest_bad_record():
    records = [example(i) for i in range(300)]
    records[250] = b"\x0a\xff"
    records[120] = b"\xff\xff\xff"
    with pytest.raises(ExampleParseError, match="record 120 is not a tf.train.Example") as info:
        parse_example(records, SPECS)
    assert info.value.record_index == 120


@pytest.mark.parametrize(
    "records, features, error, text",
    [
        ([b""], {}, TypeError, "non-empty mapping"),
        ([b""], {"a": torch.int64}, TypeError, "FixedLenFeature or VarLenFeature"),
        (["text"], {"a": VarLenFeature(torch.int64)}, TypeError, r"records\[0\] is a str"),
        ("abc", {"a": VarLenFeature(torch.int64)}, TypeError, "records must be"),
        (
            (torch.zeros(3), torch.tensor([0, 3])),
            {"a": VarLenFeature(torch.int64)},
            ValueError,
            "1-D contiguous CPU uint8",
        ),
        (
            (torch.zeros(3, dtype=torch.uint8), torch.tensor([0, 5])),
            {"a": VarLenFeature(torch.int64)},
            ValueError,
            "at most the data size 3",
        ),
    ],
)
def test_parse_example_rejects_bad_arguments(records, features, error, text):
    with pytest.raises(error, match=text):
        parse_example(records, features)


@pytest.mark.parametrize(
    "make, error, text",
    [
        (lambda: FixedLenFeature((2,), torch.int32), TypeError, "dtype must be torch.int64"),
        (lambda: FixedLenFeature((-1,), torch.int64), ValueError, "shape dimensions"),
        (lambda: FixedLenFeature("3", torch.int64), TypeError, "shape must be"),
        (
            lambda: FixedLenFeature((3,), torch.int64, default_value=[1, 2]),
            ValueError,
            r"default_value holds 2 values, the shape \(3,\) needs 3",
        ),
        (
            lambda: FixedLenFeature((3,), torch.uint8, default_value=b"ab"),
            ValueError,
            "holds 2 bytes",
        ),
        (lambda: VarLenFeature(torch.float32, default_value="x"), TypeError, "must be numbers"),
    ],
)
def test_feature_specs_validate(make, error, text):
    with pytest.raises(error, match=text):
        make()


def test_pin_memory_is_skipped_cleanly_without_an_accelerator():
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present: see the cuda test")
    out = parse_example([example(1)], SPECS, pin_memory=True)
    assert not out["d"].is_pinned() and out["s"].tolist() == [7]


@pytest.mark.parametrize("device", devices())
def test_pin_memory_when_bound_for_a_gpu(device):
    out = parse_example([example(i) for i in range(10)], SPECS, pin_memory=device == "cuda")
    assert out["s"].is_pinned() == (device == "cuda")
    assert out["v"].offsets.is_pinned() == (device == "cuda")
    on_device = out["d"].to(device, non_blocking=True)
    assert on_device[:, 0].cpu().tolist() == list(range(10))


# ------------------------------------------------------------ RecordInput


def all_records(ri):
    return [r for batch in ri for r in batch.tolist()]


def test_record_input_delivers_every_record_once_per_epoch(tmp_path):
    pattern = files(tmp_path, 4, 25)
    with RecordInput(pattern, parallelism=3, buffer_size=16, batch_size=6, epochs=2) as ri:
        assert iter(ri) is ri
        assert ri.files == sorted(str(tmp_path / f"f{k}.rec") for k in range(4))
        batches = list(ri)
        stats = ri.stats()
    assert all(isinstance(b, RecordBatch) for b in batches)
    assert [b.num_records for b in batches] == [6] * 33 + [2]
    got = [r for b in batches for r in b.tolist()]
    want = [f"f{k}r{i}".encode() for k in range(4) for i in range(25)] * 2
    assert sorted(got) == sorted(want)
    assert got[:100] != want[:100]  # shuffled
    assert stats["records_out"] == 200 and stats["readers"] == 3
    with pytest.raises(StopIteration):
        next(ri)


def test_record_input_is_deterministic_with_a_seed(tmp_path):
    pattern = files(tmp_path, 5, 30)
    kw = dict(parallelism=4, buffer_size=20, batch_size=7, epochs=2)
    runs = [all_records(RecordInput(pattern, seed=11, **kw)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    assert all_records(RecordInput(pattern, seed=12, **kw)) != runs[0]
    unseeded = [all_records(RecordInput(pattern, seed=None, **kw)) for _ in range(2)]
    assert sorted(unseeded[0]) == sorted(runs[0])


def test_record_input_shards_by_file(tmp_path):
    pattern = files(tmp_path, 5, 10)
    parts = [all_records(RecordInput(pattern, shard=(r, 3), epochs=1)) for r in range(3)]
    assert [len(p) for p in parts] == [20, 20, 10]
    # Ranks from numpy or torch arithmetic, as every other int argument takes.
    numpy_rank = all_records(RecordInput(pattern, shard=(np.int64(1), np.int32(3)), epochs=1))
    assert sorted(numpy_rank) == sorted(parts[1])
    assert sorted(itertools.chain(*parts)) == sorted(
        f"f{k}r{i}".encode() for k in range(5) for i in range(10)
    )


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_record_input_reads_compressed_files(tmp_path, compression):
    pattern = files(tmp_path, 3, 9, compression)
    assert len(all_records(RecordInput(pattern, compression=compression, epochs=1))) == 27


def test_record_input_repeats_forever_without_epochs(tmp_path):
    pattern = files(tmp_path, 2, 3)
    with RecordInput(pattern, buffer_size=4, batch_size=5) as ri:
        got = [r for b in itertools.islice(ri, 20) for r in b.tolist()]
        assert ri.stats()["epoch"] >= 10
    assert len(got) == 100 and len(set(got)) == 6


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        ({"parallelism": 0}, ValueError, "parallelism must be >= 1, got 0"),
        ({"buffer_size": -1}, ValueError, "buffer_size must be >= 1, got -1"),
        ({"batch_size": 2.0}, TypeError, "batch_size must be an int, got float"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"shift_ratio": 1.0}, ValueError, r"shift_ratio must be in \[0, 1\), got 1.0"),
        ({"compression": "lz4"}, ValueError, "compression must be"),
        ({"shard": (3, 3)}, ValueError, r"got \(3, 3\)"),
        ({"shard": 2}, TypeError, "shard must be a"),
        ({"shard": (2, 3)}, ValueError, "gets no file"),
        ({"epochs": 0}, ValueError, "epochs must be >= 1"),
        ({"prefetch_batches": 0}, ValueError, "prefetch_batches must be >= 1"),
    ],
)
def test_record_input_rejects_bad_arguments(tmp_path, kwargs, error, text):
    pattern = files(tmp_path, 2, 1)
    with pytest.raises(error, match=text):
        RecordInput(pattern, **kwargs)


def test_record_input_no_file_matches(tmp_path):
    with pytest.raises(RecordFileError, match="no file matches"):
        RecordInput(str(tmp_path / "*.rec"))
    with pytest.raises(TypeError, match="file_pattern must be"):
        RecordInput(3)


def test_record_input_reraises_a_bad_file_in_the_consumer_and_goes_on(tmp_path):
    pattern = files(tmp_path, 3, 20)
    bad = tmp_path / "f1.rec"
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # the last record's data CRC
    bad.write_bytes(bytes(raw))
    ri = RecordInput(pattern, parallelism=3, buffer_size=8, batch_size=4, epochs=1)
    got, errors = [], []
    while True:
        try:
            batch = next(ri)
        except StopIteration:
            break
        except CorruptRecordError as e:
            errors.append(e)
            continue
        got.extend(batch.tolist())
    assert len(errors) == 1
    assert errors[0].path == str(bad) and errors[0].record_index == 19
    assert "data CRC mismatch" in str(errors[0])
    assert len(got) == 59 and b"f1r19" not in got
    assert ri.stats()["errors"] == 1


def test_record_input_next_batch_timeout_and_parse(tmp_path):
    path = tmp_path / "e.rec"
    write(path, [example(i) for i in range(10)])
    ri = RecordInput(str(path), buffer_size=4, batch_size=5, epochs=1)
    batch = ri.next_batch(timeout=HANG_BOUND_S)
    out = parse_example(batch, SPECS)
    assert out["d"].shape == (5, 4)
    assert ri.next_batch(timeout=HANG_BOUND_S) is not None
    with pytest.raises(StopIteration):
        ri.next_batch(timeout=HANG_BOUND_S)
    with pytest.raises(ValueError, match="timeout must be"):
        ri.next_batch(timeout=-1)


def test_record_input_is_a_plain_iterable_for_a_dataloader(tmp_path):
    pattern = files(tmp_path, 2, 10)

    class Source(torch.utils.data.IterableDataset):
        def __iter__(self):
            return RecordInput(pattern, batch_size=4, buffer_size=4, epochs=1)

    loader = torch.utils.data.DataLoader(Source(), batch_size=None)
    got = [r for batch in loader for r in RecordBatch(*batch).tolist()]
    assert sorted(got) == sorted(f"f{k}r{i}".encode() for k in range(2) for i in range(10))


def test_close_wakes_a_consumer_blocked_on_io(tmp_path):
    # A FIFO with no writer: the reader blocks in open(), so next() waits.
    fifo = tmp_path / "pipe.rec"
    os.mkfifo(fifo)
    ri = RecordInput(str(fifo), buffer_size=2, batch_size=1)
    result = {}

    def consume():
        try:
            result["batch"] = next(ri)
        except StopIteration:
            result["stop"] = True

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    consumer.join(0.2)
    assert consumer.is_alive()  # blocked, as it should be
    closer = threading.Thread(target=ri.close, daemon=True)
    closer.start()
    consumer.join(HANG_BOUND_S)
    assert not consumer.is_alive() and result == {"stop": True}
    # close() joins the reader once its open() returns: give it a writer
    # (non-blocking: ENXIO while no reader has the FIFO open yet).
    deadline = time.monotonic() + HANG_BOUND_S
    while closer.is_alive() and time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        closer.join(0.05)
    assert not closer.is_alive()
    assert ri.stats()["closed"]


def test_interpreter_exit_and_gc_stop_the_threads(run_python, tmp_path):
    pattern = files(tmp_path, 2, 500)
    proc = run_python(
        f"""
        import gc, threading, torch_stage
        ri = torch_stage.RecordInput({pattern!r}, buffer_size=100, batch_size=10)
        next(ri)
        del ri
        gc.collect()
        ri2 = torch_stage.RecordInput({pattern!r}, buffer_size=100, batch_size=10)
        next(ri2)  # left running at exit
        print("ok")
        """
    )
    assert proc.stdout.strip() == "ok"


# -------------------------------------------- RecordInput over bad files
#
# Every outcome is taken with a bounded wait, so a pipeline that spins or
# hangs fails the test ("hang") instead of wedging the run.

BOUND_S = 10


def outcomes(ri, limit=50):
    """What successive next() calls give: record lists, RecordError
    instances, "end" (StopIteration) or "hang" (nothing within BOUND_S)."""
    got = []
    for _ in range(limit):
        try:
            batch = ri.next_batch(timeout=BOUND_S)
        except StopIteration:
            got.append("end")
            break
        except RecordError as e:
            got.append(e)
            continue
        if batch is None:
            got.append("hang")
            break
        got.append(batch.tolist())
    return got


def empty_files(tmp_path, n):
    paths = []
    for k in range(n):
        path = tmp_path / f"e{k}.rec"
        path.write_bytes(b"")
        paths.append(str(path))
    return paths


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_files", [1, 3])
def test_record_input_forever_over_empty_files_is_an_error_naming_them(tmp_path, n_files):
    paths = empty_files(tmp_path, n_files)
    with RecordInput(str(tmp_path / "*.rec"), parallelism=2, buffer_size=4, batch_size=2) as ri:
        got = outcomes(ri)
    assert len(got) == 2 and got[1] == "end", got
    error = got[0]
    assert isinstance(error, RecordFileError), got
    assert "no record" in str(error) and "epochs=None" in str(error)
    assert all(repr(p) in str(error) for p in paths)
    assert error.path == (paths[0] if n_files == 1 else None)


@pytest.mark.timeout(60)
def test_record_input_with_epochs_over_empty_files_ends_cleanly(tmp_path):
    empty_files(tmp_path, 2)
    with RecordInput(str(tmp_path / "*.rec"), batch_size=2, epochs=10**9) as ri:
        assert outcomes(ri) == ["end"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("epochs", [None, 3])
def test_record_input_over_a_file_with_no_complete_record(tmp_path, epochs):
    path = tmp_path / "t.rec"
    path.write_bytes(b"\x05\x00\x00\x00\x00")  # 5 of a header's 12 bytes
    with RecordInput(str(path), buffer_size=4, batch_size=2, epochs=epochs) as ri:
        got = outcomes(ri)
    # One pass reads no record: the error of the file, then the end (a
    # RecordFileError first when passes would repeat forever).
    assert isinstance(got[0], CorruptRecordError), got
    assert got[0].path == str(path) and "expected a 12-byte header" in str(got[0])
    if epochs is None:
        assert len(got) == 3 and isinstance(got[1], RecordFileError), got
        assert repr(str(path)) in str(got[1]) and "no record" in str(got[1])
    else:
        assert len(got) == 2, got
    assert got[-1] == "end"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("epochs", [None, 2])
def test_record_input_mixes_empty_and_non_empty_files(tmp_path, epochs):
    empty_files(tmp_path, 3)
    write(tmp_path / "f0.rec", [b"a", b"b", b"c"])
    write(tmp_path / "f1.rec", [b"d"])
    with RecordInput(
        str(tmp_path / "*.rec"), parallelism=5, buffer_size=2, batch_size=2, epochs=epochs
    ) as ri:
        got = outcomes(ri, limit=4 if epochs is None else 50)
    records = [r for item in got if isinstance(item, list) for r in item]
    if epochs is None:
        assert len(got) == 4 and len(records) == 8, got
        assert sorted(records) == sorted([b"a", b"b", b"c", b"d"] * 2)
    else:
        assert got[-1] == "end" and sorted(records) == sorted([b"a", b"b", b"c", b"d"] * 2)


@pytest.mark.timeout(60)
def test_record_input_file_deleted_while_read_forever(tmp_path):
    write(tmp_path / "f0.rec", [b"x%d" % i for i in range(5)])
    write(tmp_path / "f1.rec", [b"y%d" % i for i in range(5)])
    with RecordInput(
        str(tmp_path / "*.rec"), parallelism=2, buffer_size=2, batch_size=1, prefetch_batches=1
    ) as ri:
        assert isinstance(ri.next_batch(timeout=BOUND_S), RecordBatch)
        os.unlink(tmp_path / "f0.rec")
        got = outcomes(ri, limit=60)
    errors = [e for e in got if isinstance(e, RecordError)]
    assert errors and all(isinstance(e, RecordFileError) for e in errors), got
    assert errors[0].path == str(tmp_path / "f0.rec") and "cannot open" in str(errors[0])
    # f1 still holds records: they keep coming, no spin and no end.
    assert "hang" not in got and "end" not in got
    after = got[got.index(errors[0]) :]
    assert sum(isinstance(item, list) for item in after) >= 10, got


@pytest.mark.timeout(60)
def test_record_input_every_file_deleted_forever_is_an_error(tmp_path):
    path = tmp_path / "f0.rec"
    write(path, [b"x%d" % i for i in range(3)])
    with RecordInput(str(path), buffer_size=1, batch_size=1, prefetch_batches=1) as ri:
        assert isinstance(ri.next_batch(timeout=BOUND_S), RecordBatch)
        os.unlink(path)
        got = outcomes(ri, limit=60)
    assert got[-1] == "end", got
    assert isinstance(got[-2], RecordFileError) and "no record" in str(got[-2]), got
    assert isinstance(got[-3], RecordFileError) and "cannot open" in str(got[-3]), got


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cut", ["to_zero", "mid_record"])
def test_record_input_file_truncated_while_read_names_it(tmp_path, cut):
    path = tmp_path / "big.rec"
    records = [bytes([i % 256]) * 1000 for i in range(4000)]  # 4 MB
    write(path, records)
    with RecordInput(
        str(path), parallelism=1, buffer_size=1, batch_size=1, prefetch_batches=1, epochs=1
    ) as ri:
        assert ri.next_batch(timeout=BOUND_S).tolist() == [records[0]]
        time.sleep(0.5)  # the reader fills its queue and waits
        size = 0 if cut == "to_zero" else 3_000_000 + 7
        os.truncate(path, size)
        got = outcomes(ri, limit=5000)
    errors = [e for e in got if isinstance(e, RecordError)]
    assert len(errors) == 1 and got[-1] == "end", got[-3:]
    assert isinstance(errors[0], RecordFileError), errors
    assert errors[0].path == str(path)
    assert "shrank while being read" in str(errors[0]) and str(4000 * 1016) in str(errors[0])


def test_errors_are_exported():
    for name in ["RecordError", "RecordFileError", "CorruptRecordError", "ExampleParseError"]:
        assert issubclass(getattr(torch_stage, name), torch_stage.StageError)
    assert issubclass(FeatureError, RecordError)


def test_a_key_with_an_empty_feature_is_an_empty_row_not_the_default():
    # Example{features{feature{key: "a" value: Feature{}}}}: the key is
    # there with no list. TensorFlow parses it as zero values for a
    # variable length; the default is for records without the key.
    def field(number, payload):
        return bytes([number << 3 | 2, len(payload)]) + payload

    empty = field(1, field(1, field(1, b"a") + field(2, b"")))
    without = torch_stage.encode_example({"b": [1]})
    spec = {"a": torch_stage.VarLenFeature(torch.int64, default_value=[5])}
    got = torch_stage.parse_example([empty, without], spec)["a"]
    assert got.values.tolist() == [5]
    assert got.offsets.tolist() == [0, 0, 1]
