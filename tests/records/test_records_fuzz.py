"""Fuzzing the TFRecord reader and the Example parser from Python with
hypothesis: random bytes and mutations of the seeds in
tests/data/records_fuzz_seeds.txt (the corpus tests/cpp/test_records_fuzz.cpp
runs under `make asan`) either parse or raise a RecordError subclass, never
crash the interpreter, hang or raise anything else."""

import os
import tempfile

import pytest
import torch
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_stage import (
    CorruptRecordError,
    ExampleParseError,
    FeatureError,
    FixedLenFeature,
    RecordBatch,
    RecordFileError,
    RecordWriter,
    VarLenFeature,
    parse_example,
    read_records,
)

SEEDS_PATH = os.path.join(ROOT, "tests", "data", "records_fuzz_seeds.txt")


def _load_seeds():
    examples, files = [], []
    with open(SEEDS_PATH) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            kind, _, hexdata = line.partition(" ")
            (examples if kind == "example" else files).append(bytes.fromhex(hexdata))
    return examples, files


EXAMPLE_SEEDS, FILE_SEEDS = _load_seeds()

SPECS = {
    "d": FixedLenFeature((194,), torch.uint8, default_value=bytes(194)),
    "s": FixedLenFeature((), torch.int64, default_value=0),
    "f": VarLenFeature(torch.float32, default_value=[]),
    "b": VarLenFeature(torch.uint8, default_value=[]),
    "i": VarLenFeature(torch.int64),
}

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@st.composite
def mutated(draw, seeds):
    """A seed with a few random edits: bit flips, overwrites, truncation,
    insertions, duplicated slices."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 4))
        if op == 0 and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == 1 and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif op == 2:
            del data[draw(st.integers(0, len(data))) :]
        elif op == 3:
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            a = draw(st.integers(0, len(data) - 1))
            b = draw(st.integers(a, len(data)))
            at = draw(st.integers(0, len(data)))
            data[at:at] = data[a:b]
    return bytes(data)


example_bytes = st.one_of(st.binary(max_size=300), mutated(EXAMPLE_SEEDS))
file_bytes = st.one_of(st.binary(max_size=300), mutated(FILE_SEEDS))


def test_the_corpus_is_there_and_valid():
    assert len(EXAMPLE_SEEDS) >= 5 and len(FILE_SEEDS) >= 2
    parse_example(EXAMPLE_SEEDS, {"x": VarLenFeature(torch.int64, default_value=[])})


record_lists = st.lists(example_bytes, min_size=1, max_size=6)
compressions = st.sampled_from([None, "GZIP", "ZLIB"])


# The two properties, shared with the reliability suite's fuzz scenarios
# (tests/reliability/fuzz.py), which run them with a larger budget. Each
# returns what happened: (outcome, parsed output or records read), the
# outcome "parsed"/"read" or the name of the RecordError raised.


def check_parser(records):
    try:
        out = parse_example(records, SPECS)
    except (ExampleParseError, FeatureError) as e:
        assert e.record_index is not None and 0 <= e.record_index < len(records)
        return type(e).__name__, e
    assert out["d"].shape == (len(records), 194)
    assert out["f"].offsets[-1] == out["f"].values.numel()
    assert out["b"].value_offsets[-1] == out["b"].values.numel()
    # The same bytes as one flat batch parse the same.
    again = parse_example(RecordBatch.from_records(records), SPECS)
    assert torch.equal(again["d"], out["d"]) and torch.equal(again["i"].values, out["i"].values)
    return "parsed", out


def check_reader(data, compression):
    read = []
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "fuzz.tfrecord")
        if compression is None:
            with open(path, "wb") as f:
                f.write(data)
        else:
            # Compress the mutated framing, then damage the stream too.
            with RecordWriter(path, compression) as w:
                w.write(data)
            raw = bytearray(open(path, "rb").read())
            if len(raw) > 20:
                raw[len(raw) // 2] ^= 0x5A
            with open(path, "wb") as f:
                f.write(raw)
        try:
            for batch in read_records(path, compression, batch_size=3):
                assert batch.offsets[-1] == batch.data.numel()
                read.extend(batch.tolist())
        except (CorruptRecordError, RecordFileError) as e:
            assert e.path == path
            return type(e).__name__, read
    return "read", read


@FUZZ
@given(records=record_lists)
def test_parser_raises_record_errors_only(records):
    check_parser(records)


@FUZZ
@given(data=file_bytes, compression=compressions)
def test_reader_raises_record_errors_only(data, compression):
    check_reader(data, compression)


@pytest.mark.parametrize("seed", range(len(FILE_SEEDS)))
def test_file_seeds_read_cleanly(tmp_path, seed):
    path = tmp_path / "seed.tfrecord"
    path.write_bytes(FILE_SEEDS[seed])
    list(read_records(str(path)))
