"""Records through stages: RecordInput as a staged() source, RecordDataset as
a DataLoader source, and record errors skipped by ignored_exception_types."""

import pytest
import torch
from conftest import devices

import torch_stage
from torch_stage import FixedLenFeature, RecordDataset, RecordInput, RecordWriter

FEATURES = {"i": FixedLenFeature([], torch.int64), "v": FixedLenFeature([3], torch.float32)}


def write_files(tmp_path, n_files, per_file):
    for k in range(n_files):
        with RecordWriter(str(tmp_path / f"part-{k}.rec")) as w:
            for j in range(per_file):
                i = k * per_file + j
                w.write(torch_stage.encode_example({"i": [i], "v": [float(i), 2.0 * i, -1.0]}))
    return str(tmp_path / "part-*.rec")


def parse(batch):
    return torch_stage.parse_example(batch, FEATURES)


@pytest.mark.parametrize("num_threads", [1, 3])
def test_record_input_is_a_stage_source(tmp_path, num_threads):
    pattern = write_files(tmp_path, 4, 30)
    records = RecordInput(pattern, parallelism=2, buffer_size=20, batch_size=8, epochs=1)
    with torch_stage.staged(records, transform=parse, num_threads=num_threads, capacity=2) as s:
        seen = torch.cat([batch["i"] for batch in s])
        stats = s.stats()
    assert sorted(seen.tolist()) == list(range(120))
    assert stats["consumed"] == 15 and stats["errors"] == 0


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("device", devices())
def test_record_dataset_feeds_the_dataloader(tmp_path, num_workers, device):
    pattern = write_files(tmp_path, 4, 25)
    loader = torch_stage.DataLoader(
        RecordDataset(pattern, batch_size=10, buffer_size=16, parallelism=2),
        batch_size=None,
        num_workers=num_workers,
        transform=parse,
        device=device,
    )
    for _ in range(2):  # two epochs: each makes fresh readers
        batches = list(loader)
        ids = torch.cat([b["i"] for b in batches])
        assert ids.device.type == device
        assert sorted(ids.tolist()) == list(range(100))
        for b in batches:
            assert torch.equal(b["v"][:, 1].cpu(), 2.0 * b["i"].cpu().float())


def test_record_dataset_needs_a_file_per_worker_shard(tmp_path):
    pattern = write_files(tmp_path, 1, 5)
    with pytest.raises(ValueError, match=r"shard \(1, 2\) gets no file"):
        list(
            torch_stage.DataLoader(
                RecordDataset(pattern, batch_size=2), batch_size=None, num_workers=2
            )
        )


def test_a_corrupt_file_is_skipped_and_counted_by_a_stage(tmp_path):
    pattern = write_files(tmp_path, 3, 20)
    path = tmp_path / "part-1.rec"
    data = bytearray(path.read_bytes())
    data[40] ^= 0xFF  # breaks a data CRC in the first records
    path.write_bytes(bytes(data))
    records = RecordInput(pattern, parallelism=1, buffer_size=8, batch_size=5, epochs=1)
    with torch_stage.staged(
        records, transform=parse, ignored_exception_types=(torch_stage.CorruptRecordError,)
    ) as s:
        seen = torch.cat([b["i"] for b in s]).tolist()
        skipped = s.stats()["skipped"]
    assert skipped >= 1
    # The other files arrive whole; the bad file's records stop at the error.
    assert set(range(0, 20)) | set(range(40, 60)) <= set(seen)
    assert len(seen) == len(set(seen))


def test_an_unskipped_record_error_reaches_the_consumer(tmp_path):
    pattern = write_files(tmp_path, 2, 10)
    (tmp_path / "part-0.rec").write_bytes(b"\x01\x02\x03")  # truncated
    records = RecordInput(pattern, parallelism=1, buffer_size=4, batch_size=4, epochs=1)
    with torch_stage.staged(records) as s:
        with pytest.raises(torch_stage.CorruptRecordError) as info:
            list(s)
    assert "part-0.rec" in str(info.value)
