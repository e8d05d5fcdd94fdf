"""Interoperability of torch_stage.records with the PyPI `tfrecord` package,
an independent implementation (Python framing, the `crc32c` package,
protobuf's tf.train.Example): files we write, it reads; files it writes, we
read; Examples it serializes, we parse, and ours equal its bytes."""

import gzip
import random
import struct

import numpy as np
import pytest
import torch

from torch_stage import (
    FixedLenFeature,
    RecordWriter,
    VarLenFeature,
    encode_example,
    parse_example,
    read_records,
)

tfrecord = pytest.importorskip("tfrecord")
from tfrecord import example_pb2  # noqa: E402
from tfrecord.reader import tfrecord_loader  # noqa: E402
from tfrecord.writer import TFRecordWriter  # noqa: E402


def rows(n, seed=0):
    rng = random.Random(seed)
    return [
        {
            "d": bytes(rng.randrange(256) for _ in range(194)),
            "s": rng.randrange(-(2**40), 2**40),
            "f": [rng.uniform(-1, 1) for _ in range(rng.randrange(0, 4))],
            "i": [rng.randrange(-(2**63), 2**63) for _ in range(rng.randrange(1, 4))],
        }
        for _ in range(n)
    ]


def framed(record: bytes) -> bytes:
    length = struct.pack("<Q", len(record))
    return length + TFRecordWriter.masked_crc(length) + record + TFRecordWriter.masked_crc(record)


def test_framing_byte_vectors_match_tfrecord(tmp_path):
    for record in [b"", b"hello", bytes(range(256))]:
        path = tmp_path / "one"
        with RecordWriter(path) as w:
            w.write(record)
        assert path.read_bytes() == framed(record)


@pytest.mark.parametrize("compression", [None, "GZIP"])
def test_files_we_write_are_read_by_tfrecord(tmp_path, compression):
    data = rows(40)
    path = tmp_path / "ours.tfrecord"
    with RecordWriter(path, compression) as w:
        for r in data:
            # A float list can be empty; give it its type.
            w.write(encode_example({**r, "f": (r["f"], torch.float32)}))
    loaded = list(
        tfrecord_loader(
            str(path),
            None,
            {"d": "byte", "s": "int", "f": "float", "i": "int"},
            compression_type=None if compression is None else "gzip",
        )
    )
    assert len(loaded) == len(data)
    for got, want in zip(loaded, data):
        assert bytes(got["d"]) == want["d"]
        assert got["s"].tolist() == [want["s"]]
        assert got["i"].tolist() == want["i"]
        np.testing.assert_allclose(got["f"], np.array(want["f"], dtype=np.float32))


def test_files_tfrecord_writes_are_read_by_us(tmp_path):
    data = rows(60, seed=1)
    path = tmp_path / "theirs.tfrecord"
    writer = TFRecordWriter(str(path))
    for r in data:
        writer.write(
            {
                "d": (r["d"], "byte"),
                "s": (r["s"], "int"),
                "f": (r["f"], "float"),
                "i": (r["i"], "int"),
            }
        )
    writer.close()
    records = list(read_records(str(path)))
    assert len(records) == 60
    out = parse_example(
        records,
        {
            "d": FixedLenFeature((194,), torch.uint8),
            "s": FixedLenFeature((), torch.int64),
            "f": VarLenFeature(torch.float32, default_value=[]),
            "i": VarLenFeature(torch.int64),
        },
    )
    for k, r in enumerate(data):
        assert out["d"][k].numpy().tobytes() == r["d"]
        assert out["s"][k].item() == r["s"]
        assert out["i"].row(k).tolist() == r["i"]
        assert out["f"].row(k).tolist() == pytest.approx(r["f"], rel=1e-6)


def test_gzip_files_made_by_gzip_are_read_by_us(tmp_path):
    # The tfrecord package reads GZIP but writes none; Python's gzip module
    # compresses its uncompressed output instead.
    plain = tmp_path / "plain"
    writer = TFRecordWriter(str(plain))
    for i in range(25):
        writer.write({"s": (i, "int")})
    writer.close()
    gz = tmp_path / "theirs.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    out = parse_example(
        list(read_records(str(gz), "GZIP")), {"s": FixedLenFeature((), torch.int64)}
    )
    assert out["s"].tolist() == list(range(25))


def test_protobuf_examples_parse_and_our_encoding_equals_theirs():
    feature = example_pb2.Feature
    for r in rows(30, seed=2):
        ours = encode_example({"d": r["d"], "i": r["i"]})
        theirs = example_pb2.Example(
            features=example_pb2.Features(
                feature={
                    "d": feature(bytes_list=example_pb2.BytesList(value=[r["d"]])),
                    "i": feature(int64_list=example_pb2.Int64List(value=r["i"])),
                }
            )
        )
        # Map order on the wire is protobuf's choice: compare parsed values,
        # and bytes for single-feature Examples.
        back = example_pb2.Example()
        back.ParseFromString(ours)
        assert back == theirs
        single = example_pb2.Example(
            features=example_pb2.Features(
                feature={"i": feature(int64_list=example_pb2.Int64List(value=r["i"]))}
            )
        )
        assert encode_example({"i": r["i"]}) == single.SerializeToString()
        parsed = parse_example(
            [theirs.SerializeToString()],
            {"d": FixedLenFeature((194,), torch.uint8), "i": VarLenFeature(torch.int64)},
        )
        assert parsed["d"][0].numpy().tobytes() == r["d"]
        assert parsed["i"].row(0).tolist() == r["i"]


def test_unpacked_encodings_from_protobuf_parse():
    # proto2-style unpacked repeated scalars (each value its own field) are
    # legal on the wire; build them by hand from protobuf's own pieces.
    values = [3, -4, 2**40]
    unpacked = b"".join(
        b"\x08" + example_pb2.Int64List(value=[v]).SerializeToString()[2:] for v in values
    )
    feature = b"\x1a" + bytes([len(unpacked)]) + unpacked
    entry = b"\x0a\x01k\x12" + bytes([len(feature)]) + feature
    features = b"\x0a" + bytes([len(entry)]) + entry
    example = b"\x0a" + bytes([len(features)]) + features
    parsed_by_protobuf = example_pb2.Example()
    parsed_by_protobuf.ParseFromString(example)
    assert list(parsed_by_protobuf.features.feature["k"].int64_list.value) == values
    out = parse_example([example], {"k": VarLenFeature(torch.int64)})
    assert out["k"].row(0).tolist() == values


def test_criteo_like_rows_parse_as_protobuf_reads_them_one_by_one():
    # The benchmark's rows (benchmarks/records_vs_tf_data.py), serialized by
    # protobuf (map order its own), parsed as one batch by torch_stage and
    # one Example at a time by protobuf: the same values. Negative counts
    # take 10 varint bytes; a multi-hot feature with no id is an empty
    # Feature (no list set), which reads as an empty list.
    rng = random.Random(15)
    dense = [f"I{k}" for k in range(1, 14)]
    single = [f"C{k}" for k in range(1, 21)]
    multi = [f"C{k}" for k in range(21, 27)]
    records = []
    for _ in range(700):
        ex = example_pb2.Example()
        f = ex.features.feature
        f["label"].int64_list.value.append(rng.randrange(2))
        for key in dense:
            f[key].int64_list.value.append(rng.choice([-1, 0, rng.randrange(1000), 2**40]))
        for key in single:
            f[key].int64_list.value.append(rng.randrange(2**32))
        for key in multi:
            ids = [rng.randrange(2**32) for _ in range(rng.randrange(7))]
            if ids:
                f[key].int64_list.value.extend(ids)
            else:
                f[key].SetInParent()
        records.append(ex.SerializeToString())
    specs = {key: FixedLenFeature((), torch.int64) for key in ["label", *dense, *single]}
    specs.update({key: VarLenFeature(torch.int64) for key in multi})
    out = parse_example(records, specs)
    one_by_one = [example_pb2.Example.FromString(r).features.feature for r in records]
    for key in ["label", *dense, *single]:
        assert out[key].tolist() == [f[key].int64_list.value[0] for f in one_by_one], key
    for key in multi:
        rows_ = [out[key].row(i).tolist() for i in range(len(records))]
        assert rows_ == [list(f[key].int64_list.value) for f in one_by_one], key
    assert any(not f[multi[0]].HasField("int64_list") for f in one_by_one)
