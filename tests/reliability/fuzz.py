"""Fuzzing: the TFRecord framing and the Example parser fed random and mutated
bytes give a result or a RecordError (CorruptRecordError for framing,
ExampleParseError/FeatureError for Examples), never a crash, a hang, an
unbounded allocation or bytes from outside the input.

The strategies (random bytes, mutations of the seeds in
tests/data/records_fuzz_seeds.txt) and the two properties are those of
tests/records/test_records_fuzz.py, run here with a larger budget, plus differential
checks that only a scenario can afford: an over-read past a record's end or
a reader that returns bytes it did not read shows up as a difference between
a record parsed alone and in a batch, or between the records read and the
file's own frames.

The same corpus runs under AddressSanitizer in tests/cpp/test_records_fuzz.cpp
(`make asan`).

Seeds: the quick profile uses seed 0 and the full one seed 1, so CI runs
the same examples every time; TORCH_STAGE_FUZZ_SEED=N explores others
(``random`` for a fresh one). Every run prints its seed, which reproduces a
failure. No example database is read or written.
"""

from __future__ import annotations

import collections
import os
import random
import resource
import struct
import tempfile
import time

from reliability.harness import check, scenario


def _seed(seed):
    env = os.environ.get("TORCH_STAGE_FUZZ_SEED")
    if env:
        seed = None if env == "random" else int(env)
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    print(f"hypothesis seed {seed} (TORCH_STAGE_FUZZ_SEED={seed} reproduces it)", flush=True)
    return seed


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Run:
    """One property run by hypothesis: counts outcomes and times examples."""

    def __init__(self):
        self.outcomes = collections.Counter()
        self.slowest_s = 0.0
        self.records = 0
        self.decoded = 0

    def time(self, f, *args):
        start = time.perf_counter()
        out = f(*args)
        self.slowest_s = max(self.slowest_s, time.perf_counter() - start)
        return out


def _hypothesis(prop, examples: int, seed: int, **strategies) -> None:
    import hypothesis
    from records import test_records_fuzz as shared

    test = hypothesis.given(**strategies)(prop)
    test = hypothesis.settings(
        max_examples=examples,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(shared.FUZZ.suppress_health_check)
        + [hypothesis.HealthCheck.data_too_large],
    )(test)
    hypothesis.seed(seed)(test)()


# ---------------------------------------------------------------- the parser


def _same(a, b) -> bool:
    """Bit-equal tensors (floats compared as bits: random bytes make NaNs)."""
    import torch

    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a, b)


def _rows_match(batch: dict, i: int, alone: dict) -> bool:
    for key, value in batch.items():
        if hasattr(value, "row"):  # Ragged
            mine, theirs = value.row(i), alone[key].row(0)
            if isinstance(mine, list):
                if mine != theirs:
                    return False
            elif not _same(mine, theirs):
                return False
        elif not _same(value[i], alone[key][0]):
            return False
    return True


def _lenient_specs():
    """The shared specs with every feature defaulted, so that most mutated
    Examples parse and their values are decoded (the shared specs require
    "i", which few mutations keep)."""
    import torch
    from records.test_records_fuzz import SPECS

    from torch_stage import VarLenFeature

    return {**SPECS, "i": VarLenFeature(torch.int64, default_value=[])}


def _parse(records, specs):
    """(outcome, output or error) of parse_example."""
    from torch_stage import ExampleParseError, FeatureError, parse_example

    try:
        return "parsed", parse_example(records, specs)
    except (ExampleParseError, FeatureError) as e:
        check(
            e.record_index is not None and 0 <= e.record_index < len(records),
            f"{type(e).__name__} names record {e.record_index} of {len(records)}",
        )
        return type(e).__name__, e


def _parser_alone(records, outcome, got, specs) -> int:
    """Each record parsed alone agrees with the batch: the same row when the
    batch parsed; when it raised for record k, the records before k parse
    (the error names the lowest failing record), with the same rows alone,
    and record k alone raises the same error. A parser that reads past a
    record's end into its neighbour's bytes breaks this. Returns how many
    records were decoded and compared."""
    from torch_stage import RecordError, parse_example

    if outcome != "parsed":
        k = got.record_index
        try:
            parse_example([records[k]], specs)
        except RecordError as e:
            check(
                type(e) is type(got) and e.record_index == 0 and e.key == got.key,
                f"record {k} alone raises {type(e).__name__} ({e}), in its batch "
                f"{type(got).__name__} ({got}): {records!r}",
            )
        else:
            raise AssertionError(f"record {k} alone parses, in its batch it raised {got}")
        if k == 0:
            return 0
        try:
            records, got = records[:k], parse_example(records[:k], specs)
        except RecordError as e:
            raise AssertionError(
                f"the batch's error names record {k}, not the lowest failing one "
                f"({type(e).__name__} at {e.record_index}): {records!r}"
            ) from e
    for i, record in enumerate(records):
        alone = parse_example([record], specs)
        check(
            _rows_match(got, i, alone),
            f"record {i} parses differently alone than in its batch: {records!r}",
        )
    return len(records)


@scenario(
    "fuzz.example_parser",
    timeout_s=300,
    quick={"examples": 300, "seed": 0},
    full={"examples": 10000, "seed": 1},
)
def example_parser(examples: int, seed) -> dict:
    """Example parser on random/mutated bytes: parses or raises a RecordError"""
    from records import test_records_fuzz as shared

    seed = _seed(seed)
    run = _Run()
    lenient = _lenient_specs()
    lenient_outcomes = collections.Counter()
    rss_before = _rss_mb()
    start = time.monotonic()

    def prop(records):
        outcome, got = run.time(shared.check_parser, records)
        run.decoded += _parser_alone(records, outcome, got, shared.SPECS)
        run.outcomes[outcome] += 1
        outcome, got = run.time(_parse, records, lenient)
        run.decoded += _parser_alone(records, outcome, got, lenient)
        lenient_outcomes[outcome] += 1
        run.records += len(records)

    _hypothesis(prop, examples, seed, records=shared.record_lists)
    ran = sum(run.outcomes.values())
    check(ran >= examples // 2, f"hypothesis ran {ran} examples of the {examples} asked")
    check(
        lenient_outcomes["parsed"] > 0,
        f"no input parsed: the fuzzing is all noise {lenient_outcomes}",
    )
    check(
        run.outcomes["ExampleParseError"] > 0,
        f"no ExampleParseError: the mutations never reach the parser's checks {run.outcomes}",
    )
    grew = _rss_mb() - rss_before
    check(grew < 1024, f"peak memory grew by {grew:.0f} MB on inputs of a few kB")
    return {
        "seed": seed,
        "examples": ran,
        "records": run.records,
        # Records decoded in a batch and alone, and compared.
        "records_decoded": run.decoded,
        **{k: run.outcomes[k] for k in ("parsed", "ExampleParseError", "FeatureError")},
        # The same inputs with every feature defaulted.
        **{
            f"lenient_{k}": lenient_outcomes[k]
            for k in ("parsed", "ExampleParseError", "FeatureError")
        },
        "slowest_example_ms": run.slowest_s * 1e3,
        "peak_rss_growth_mb": grew,
        "seconds": time.monotonic() - start,
    }


# ------------------------------------------------------------- the framing


def _frames(data: bytes, records, error) -> None:
    """The records an uncompressed file gave are its frames, in order, byte
    for byte, each with valid length and data CRCs; an error is raised at the
    first frame that is not whole, and names its offset and index."""
    try:
        import crc32c
    except ImportError:  # the tfrecord package's dependency; optional here
        crc32c = None

    def masked(b: bytes) -> int:
        c = crc32c.crc32c(b)
        return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    pos = 0
    for i, record in enumerate(records):
        header = data[pos : pos + 12]
        check(len(header) == 12, f"record {i} read past the end of the file")
        (length,) = struct.unpack("<Q", header[:8])
        check(length == len(record), f"record {i}: {len(record)} bytes, its frame says {length}")
        body = data[pos + 12 : pos + 12 + length]
        check(body == record, f"record {i}: the bytes read are not the file's")
        if crc32c is not None:
            (length_crc,) = struct.unpack("<I", header[8:])
            (data_crc,) = struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])
            check(
                masked(header[:8]) == length_crc and masked(body) == data_crc,
                f"record {i} was returned with a CRC that does not match",
            )
        pos += 16 + length
    if error is None:
        check(pos == len(data), f"the reader stopped at byte {pos} of {len(data)} with no error")
    else:
        check(
            error.offset == pos and error.record_index == len(records),
            f"{type(error).__name__} names offset {error.offset}, record {error.record_index}; "
            f"the first bad frame is record {len(records)} at {pos}: {error}",
        )


def _read_one_by_one(path: str):
    """The other read path: one bytes object per record."""
    from torch_stage import CorruptRecordError, read_records

    got = []
    try:
        for record in read_records(path):
            got.append(record)
    except CorruptRecordError as e:
        return got, e
    return got, None


@scenario(
    "fuzz.record_framing",
    timeout_s=300,
    quick={"examples": 300, "seed": 0},
    full={"examples": 10000, "seed": 1},
)
def record_framing(examples: int, seed) -> dict:
    """TFRecord reader on random/mutated files: reads or raises CorruptRecordError"""
    from records import test_records_fuzz as shared

    seed = _seed(seed)
    run = _Run()
    rss_before = _rss_mb()
    start = time.monotonic()
    compressed = collections.Counter()
    frames = collections.Counter()
    workdir = tempfile.mkdtemp(prefix="torch_stage_fuzz_")
    path = os.path.join(workdir, "plain.tfrecord")

    def prop(data, compression):
        outcome, read = run.time(shared.check_reader, data, compression)
        if compression is None:
            check(outcome != "RecordFileError", f"RecordFileError on a readable file: {data!r}")
            with open(path, "wb") as f:
                f.write(data)
            one_by_one, error = run.time(_read_one_by_one, path)
            _frames(data, one_by_one, error)
            frames["files"] += 1
            frames["records"] += len(one_by_one)
            # Batches deliver the same records: those before a bad frame too
            # (as RecordInput does), not only the batches completed before it.
            check(
                one_by_one == read and (error is None) == (outcome == "read"),
                f"read_records(batch_size=3) gave {len(read)} records then {outcome}; one by "
                f"one {len(one_by_one)} records then {error!r}; the file: {data!r}",
            )
        else:
            compressed[outcome] += 1
        run.outcomes[outcome] += 1
        run.records += len(read)

    try:
        _hypothesis(prop, examples, seed, data=shared.file_bytes, compression=shared.compressions)
    finally:
        if os.path.exists(path):
            os.remove(path)
        os.rmdir(workdir)
    ran = sum(run.outcomes.values())
    check(ran >= examples // 2, f"hypothesis ran {ran} examples of the {examples} asked")
    check(run.outcomes["read"] > 0, f"no file read cleanly: all noise {run.outcomes}")
    check(
        run.outcomes["CorruptRecordError"] > 0,
        f"no CorruptRecordError: the mutations never reach the reader's checks {run.outcomes}",
    )
    grew = _rss_mb() - rss_before
    check(grew < 1024, f"peak memory grew by {grew:.0f} MB on files of a few kB")
    return {
        "seed": seed,
        "examples": ran,
        "records": run.records,
        **{k: run.outcomes[k] for k in ("read", "CorruptRecordError", "RecordFileError")},
        "compressed": sum(compressed.values()),
        # Uncompressed files whose records were checked against their frames.
        "frame_checked_files": frames["files"],
        "frame_checked_records": frames["records"],
        "slowest_example_ms": run.slowest_s * 1e3,
        "peak_rss_growth_mb": grew,
        "seconds": time.monotonic() - start,
    }
