"""Byte-level corpora and batches: vocabulary 256, a token is a byte value.

Bytes need no tokenizer and no download, so any text on disk (by default the
Python standard library that ships with the interpreter) is a training corpus.
Everything here is deterministic: the same corpus, seed and rank give the same
batches on every run.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 8_000_000

# Suffixes read from a corpus directory; files with no suffix (README, LICENSE...) too.
TEXT_SUFFIXES = frozenset({
    ".txt", ".md", ".py", ".rst", ".json", ".c", ".h", ".js", ".ts", ".rs", ".go",
    ".java", ".html", ".css", ".yaml", ".yml", ".toml", ".csv",
})

# Standard-library folders left out of the default corpus: tests are huge and
# repetitive, the rest are tools rather than library code or (site-packages)
# depend on what is installed, which would make the corpus differ between machines.
_STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3",
    "__pycache__", "turtledemo", "ensurepip",
})

Batch = dict[str, torch.Tensor]


class DataError(ValueError):
    """A corpus that cannot be used; the message names the path or the setting at fault."""


# --------------------------------------------------------------------------- corpus


def default_corpus_files(max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path, up to ``max_bytes``.

    The last file listed may push the total past ``max_bytes``; ``load_corpus``
    truncates. ``max_bytes=None`` lists them all.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"standard library folder not found: {root}")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        for fn in filenames:
            # _sysconfigdata* is generated per build, so it would vary between machines.
            if fn.endswith(".py") and not fn.startswith("_sysconfigdata"):
                p = Path(dirpath, fn)
                found.append((p.relative_to(root).as_posix(), p))
    # Sort on the relative path, not os.walk order, which depends on the file system.
    found.sort(key=lambda t: t[0])
    files: list[Path] = []
    total = 0
    for _, p in found:
        if max_bytes is not None and total >= max_bytes:
            break
        files.append(p)
        total += p.stat().st_size
    if not files:
        raise DataError(f"no .py files found in the standard library folder {root}")
    return files


def _is_text_candidate(p: Path) -> bool:
    return p.suffix.lower() in TEXT_SUFFIXES or p.suffix == ""


def _directory_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Hidden folders (.git, .venv...) hold tooling and binary objects, not corpus text.
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        files.extend(Path(dirpath, fn) for fn in filenames
                     if not fn.startswith(".") and _is_text_candidate(Path(fn)))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    return files


def _read_text_files(files: Sequence[Path], max_bytes: int | None, *,
                     skip_bad: bool) -> bytes:
    """Concatenate text files up to ``max_bytes``, skipping binary/unreadable ones if asked."""
    parts: list[bytes] = []
    total = 0
    for p in files:
        # A newline between files keeps one file's last line from running into the next.
        sep = b"\n" if parts and not parts[-1].endswith(b"\n") else b""
        remaining = None if max_bytes is None else max_bytes - total - len(sep)
        if remaining is not None and remaining <= 0:
            break
        try:
            with open(p, "rb") as fh:
                chunk = fh.read() if remaining is None else fh.read(remaining)
        except OSError as exc:
            if skip_bad:
                continue
            raise DataError(f"cannot read corpus file {p}: {exc}") from exc
        if b"\0" in chunk:  # NUL bytes do not occur in text: a binary file
            if skip_bad:
                continue
            raise DataError(f"corpus file {p} looks binary (contains NUL bytes)")
        if not chunk:
            continue
        parts.extend((sep, chunk))
        total += len(sep) + len(chunk)
    return b"".join(parts)


def load_corpus(path: str | os.PathLike[str] | None,
                max_bytes: int | None = DEFAULT_MAX_BYTES) -> bytes:
    """Read a corpus as bytes, at most ``max_bytes`` (``None``: no cap).

    ``path`` is ``None`` for the standard-library default corpus, a text file, or a
    folder read recursively (text suffixes in ``TEXT_SUFFIXES`` and suffix-less
    files, sorted by path; binary files, hidden and unreadable ones skipped).
    Raises ``DataError`` naming the path when it is missing, has no text, or is empty.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    if path is None:
        files = default_corpus_files(max_bytes)
        raw = _read_text_files(files, max_bytes, skip_bad=True)
        where = f"standard library at {sysconfig.get_paths()['stdlib']}"
    else:
        p = Path(path)
        where = str(p)
        if not p.exists():
            raise DataError(f"corpus path does not exist: {p}")
        if p.is_dir():
            files = _directory_files(p)
            raw = _read_text_files(files, max_bytes, skip_bad=True)
            if not raw:
                if not files:
                    raise DataError(
                        f"corpus directory {p} has no readable text files (looked for "
                        f"{', '.join(sorted(TEXT_SUFFIXES))} and files with no suffix)")
                raise DataError(f"corpus directory {p} has no readable text: its "
                                f"{len(files)} candidate files are empty, binary or "
                                f"unreadable")
        elif p.is_file():
            raw = _read_text_files([p], max_bytes, skip_bad=False)
        else:
            raise DataError(f"corpus path is neither a file nor a directory: {p}")
    if not raw:
        raise DataError(f"corpus is empty: {where}")
    return raw


# --------------------------------------------------------------------------- dataset


def _check_length(n: int, seq_len: int, what: str) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if n < seq_len + 1:
        raise DataError(f"{what} has {n} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
                        f"use a larger corpus or a smaller seq_len")


class ByteDataset:
    """A corpus held as a 1-D ``uint8`` tensor, one element per byte."""

    def __init__(self, data: torch.Tensor, name: str = "corpus") -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise DataError(f"{name}: expected a 1-D uint8 tensor, got "
                            f"{data.dtype} with shape {tuple(data.shape)}")
        self.data = data
        self.name = name

    @classmethod
    def from_bytes(cls, raw: bytes, name: str = "corpus") -> "ByteDataset":
        """Wrap bytes (copied, so the tensor owns writable memory)."""
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8), name)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None,
             max_bytes: int | None = DEFAULT_MAX_BYTES) -> "ByteDataset":
        """``load_corpus(path, max_bytes)`` as a dataset named after the path."""
        name = "default corpus (Python standard library)" if path is None else str(path)
        return cls.from_bytes(load_corpus(path, max_bytes), name)

    def __len__(self) -> int:
        return int(self.data.numel())

    def split(self, val_fraction: float = 0.05,
              seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Split into ``(train, val)`` tensors: the last ``val_fraction`` is validation.

        The split is contiguous so validation text is never seen in training. With
        ``seq_len``, both parts must hold at least ``seq_len + 1`` bytes.
        """
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n = len(self)
        n_val = max(1, round(n * val_fraction))
        n_train = n - n_val
        if seq_len is not None:
            _check_length(n_train, seq_len, f"training split of {self.name}")
            _check_length(n_val, seq_len,
                          f"validation split ({val_fraction:g} of {n} bytes) of {self.name}")
        elif n_train < 1:
            raise DataError(f"{self.name} has {n} bytes, too few to split")
        return self.data[:n_train], self.data[n_train:]


# --------------------------------------------------------------------------- batches


def _rank_seed(seed: int, rank: int) -> int:
    # A hash, not seed + rank, so that (seed, rank) pairs never share a stream;
    # hashlib rather than hash() because it is the same in every process.
    digest = hashlib.sha256(f"ds_hybrid.train_batches:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> Batch:
    idx = starts.unsqueeze(1) + torch.arange(seq_len).unsqueeze(0)
    ids = data[idx].long()
    # labels == input_ids: Hugging Face causal LMs shift the labels internally.
    return {"input_ids": ids, "labels": ids.clone()}


def train_batches(data: torch.Tensor, seq_len: int, batch_size: int, seed: int,
                  rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
    """Endless batches of random windows, reproducible per ``(seed, rank)``.

    Each batch is ``{"input_ids", "labels"}``, both ``LongTensor[batch_size, seq_len]``.
    Every rank draws its offsets from its own generator, so ranks read different
    samples and a rerun with the same seed reads the same ones.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank must be in [0, world_size), got rank={rank}, "
                        f"world_size={world_size}")
    _check_length(int(data.numel()), seq_len, "training data")
    gen = torch.Generator().manual_seed(_rank_seed(seed, rank))
    high = int(data.numel()) - seq_len + 1  # exclusive: last full window starts at n - seq_len
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=gen)
        yield _windows(data, starts, seq_len)


def val_batches(data: torch.Tensor, seq_len: int, batch_size: int,
                max_batches: int | None = None) -> list[Batch]:
    """Non-overlapping windows from the start of ``data``, in order, as batches.

    Identical on every rank. The last batch may hold fewer than ``batch_size`` rows;
    ``evaluate`` weights batches by their rows, so every window counts once.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise DataError(f"max_batches must be >= 1 or None, got {max_batches}")
    _check_length(int(data.numel()), seq_len, "validation data")
    n_windows = int(data.numel()) // seq_len
    if max_batches is not None:
        n_windows = min(n_windows, max_batches * batch_size)
    starts = torch.arange(n_windows) * seq_len
    return [_windows(data, chunk, seq_len) for chunk in starts.split(batch_size)]


def evaluate(forward_loss_fn: Callable[[Batch], torch.Tensor],
             batches: Sequence[Batch]) -> float:
    """Mean loss over ``batches`` under ``torch.no_grad``, weighted by batch rows.

    ``forward_loss_fn(batch)`` returns the scalar mean loss of one batch; the caller
    moves it to its device and sets eval mode.
    """
    if not batches:
        raise DataError("evaluate() needs at least one batch")
    total = 0.0
    rows = 0
    with torch.no_grad():
        for batch in batches:
            n = int(batch["input_ids"].shape[0])
            total += float(forward_loss_fn(batch).detach().float().cpu()) * n
            rows += n
    return total / rows
