"""Corpus loading, splitting and batching in ds_hybrid.data."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from ds_hybrid.data import (ByteDataset, DataError, default_corpus_files, evaluate,
                            load_corpus, train_batches, val_batches)


def _dataset(n: int = 10_000) -> ByteDataset:
    raw = bytes((i * 7 + i // 13) % 256 for i in range(n))
    return ByteDataset.from_bytes(raw, name="synthetic")


# ----------------------------------------------------------------- default corpus


def test_default_corpus_files_sorted_capped_and_filtered() -> None:
    files = default_corpus_files(max_bytes=300_000)
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    skipped = {"site-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(skipped & set(Path(r).parts[:-1]) for r in rel)
    sizes = [f.stat().st_size for f in files]
    # Stops as soon as the cap is reached: all but the last file fit under it.
    assert sum(sizes[:-1]) < 300_000
    assert default_corpus_files(max_bytes=300_000) == files


def test_load_default_corpus_respects_max_bytes() -> None:
    raw = load_corpus(None, max_bytes=200_000)
    assert len(raw) == 200_000
    assert b"\0" not in raw
    assert b"def " in raw and b"import " in raw
    assert load_corpus(None, max_bytes=200_000) == raw


# ----------------------------------------------------------------- files and dirs


def test_load_single_file_and_truncation(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world\n")
    assert load_corpus(f) == b"hello world\n"
    assert load_corpus(str(f), max_bytes=5) == b"hello"


def test_load_directory_recursive_sorted_skips_binary_and_other_suffixes(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "a.md").write_bytes(b"alpha")           # no trailing newline: one is put after
    (tmp_path / "b" / "c.py").write_bytes(b"gamma\n")
    (tmp_path / "README").write_bytes(b"readme\n")       # no suffix: read
    (tmp_path / "blob.txt").write_bytes(b"bin\0ary")     # NUL bytes: skipped
    (tmp_path / "image.png").write_bytes(b"png data")    # not a text suffix: skipped
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: x\n")  # hidden folder: skipped
    # Sorted by relative path ("README" < "a.md" < "b/c.py"), one newline between files.
    assert load_corpus(tmp_path) == b"readme\nalpha\ngamma\n"


def test_missing_path_error_names_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "corpus.txt"
    with pytest.raises(DataError, match="does not exist") as exc:
        load_corpus(missing)
    assert str(missing) in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_directory_without_text_files_error_names_path(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(DataError, match="no readable text files") as exc:
        load_corpus(tmp_path)
    assert str(tmp_path) in str(exc.value)


def test_directory_with_only_binary_text_named_files(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_bytes(b"a\0b")
    with pytest.raises(DataError, match=str(tmp_path)):
        load_corpus(tmp_path)


def test_empty_file_error_names_path(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    with pytest.raises(DataError, match="empty") as exc:
        load_corpus(f)
    assert str(f) in str(exc.value)


def test_explicit_binary_file_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "data.txt"
    f.write_bytes(b"abc\0def")
    with pytest.raises(DataError, match="binary") as exc:
        load_corpus(f)
    assert str(f) in str(exc.value)


# ----------------------------------------------------------------- dataset split


def test_byte_dataset_roundtrip_and_load(tmp_path: Path) -> None:
    f = tmp_path / "c.txt"
    f.write_bytes(bytes(range(1, 256)) * 4)
    ds = ByteDataset.load(f)
    assert ds.data.dtype == torch.uint8 and len(ds) == 255 * 4
    assert bytes(ds.data.tolist()) == f.read_bytes()
    assert str(f) in ds.name


def test_split_sizes_contiguous_and_disjoint() -> None:
    ds = _dataset(10_000)
    train, val = ds.split(0.05, seq_len=64)
    assert len(train) == 9_500 and len(val) == 500
    # Contiguous: train then val rebuild the corpus exactly, val is the tail.
    assert torch.equal(torch.cat([train, val]), ds.data)
    assert train.data_ptr() + train.numel() == val.data_ptr()
    train2, val2 = ds.split(0.05, seq_len=64)
    assert torch.equal(train, train2) and torch.equal(val, val2)


def test_split_too_short_names_corpus_and_seq_len() -> None:
    ds = _dataset(1_000)
    with pytest.raises(DataError) as exc:
        ds.split(0.05, seq_len=64)  # validation part holds 50 bytes
    msg = str(exc.value)
    assert "synthetic" in msg and "seq_len" in msg and "65" in msg and "validation" in msg


def test_split_rejects_bad_fraction() -> None:
    with pytest.raises(DataError, match="val_fraction"):
        _dataset(100).split(0.0)
    with pytest.raises(DataError, match="val_fraction"):
        _dataset(100).split(1.0)


# ----------------------------------------------------------------- batches


def _take(it, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def test_train_batches_shape_dtype_and_content() -> None:
    data = _dataset(5_000).data
    batch = next(train_batches(data, seq_len=32, batch_size=4, seed=0))
    assert set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (4, 32) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["labels"], batch["input_ids"])
    # Every row is a real window of the corpus.
    hay = bytes(data.tolist())
    for row in batch["input_ids"]:
        assert bytes(row.tolist()) in hay


def test_train_batches_deterministic_per_seed_and_rank() -> None:
    data = _dataset(5_000).data
    a = _take(train_batches(data, 16, 8, seed=3, rank=1, world_size=2), 5)
    b = _take(train_batches(data, 16, 8, seed=3, rank=1, world_size=2), 5)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    # Successive batches differ (the generator advances).
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])


def test_train_batches_differ_across_ranks_and_seeds() -> None:
    data = _dataset(5_000).data
    r0 = _take(train_batches(data, 16, 8, seed=3, rank=0, world_size=2), 3)
    r1 = _take(train_batches(data, 16, 8, seed=3, rank=1, world_size=2), 3)
    s4 = _take(train_batches(data, 16, 8, seed=4, rank=0, world_size=2), 3)
    for x, y, z in zip(r0, r1, s4):
        assert not torch.equal(x["input_ids"], y["input_ids"])
        assert not torch.equal(x["input_ids"], z["input_ids"])


def test_train_batches_reach_both_ends() -> None:
    # Offsets cover [0, n - seq_len]: with a corpus one byte longer than a window
    # both possible windows appear.
    data = torch.arange(9, dtype=torch.uint8)
    firsts = {int(b["input_ids"][0, 0]) for b in _take(train_batches(data, 8, 1, seed=0), 50)}
    assert firsts == {0, 1}


def test_train_batches_errors() -> None:
    data = _dataset(100).data
    with pytest.raises(DataError, match="seq_len"):
        next(train_batches(data, 100, 2, seed=0))
    with pytest.raises(DataError, match="rank"):
        next(train_batches(data, 8, 2, seed=0, rank=2, world_size=2))


def test_val_batches_non_overlapping_in_order() -> None:
    data = _dataset(1_000).data
    batches = val_batches(data, seq_len=64, batch_size=4)
    rows = torch.cat([b["input_ids"] for b in batches])
    assert rows.shape == (1_000 // 64, 64)       # 15 windows: 4 + 4 + 4 + 3
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 4, 3]
    assert torch.equal(rows.flatten(), data[: 15 * 64].long())
    again = val_batches(data, seq_len=64, batch_size=4)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again))
    assert len(val_batches(data, 64, 4, max_batches=2)) == 2


def test_val_batches_too_short_names_seq_len() -> None:
    with pytest.raises(DataError, match="seq_len"):
        val_batches(_dataset(50).data, seq_len=64, batch_size=2)


def test_evaluate_weighted_mean_without_grad() -> None:
    data = _dataset(1_000).data
    batches = val_batches(data, seq_len=64, batch_size=4)   # rows 4, 4, 4, 3
    seen_grad: list[bool] = []

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen_grad.append(torch.is_grad_enabled())
        return batch["input_ids"].float().mean()

    expected = torch.cat([b["input_ids"] for b in batches]).float().mean().item()
    assert evaluate(loss_fn, batches) == pytest.approx(expected, rel=1e-6)
    assert seen_grad and not any(seen_grad)
    with pytest.raises(DataError):
        evaluate(loss_fn, [])
