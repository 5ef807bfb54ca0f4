"""Checkpoints that hold the whole training state and survive a kill in the middle of a save.

``PredictiveEngine.save_checkpoint`` / ``load_checkpoint`` call ``save_atomic`` /
``load_verified`` below around DeepSpeed's own save and load. What is where::

    save_dir/
      latest                     tag of the newest complete checkpoint (DeepSpeed's file);
                                 replaced atomically, and only after the tag folder is complete
      <tag>/                     DeepSpeed's files (mp_rank_00_model_states.pt, zero_pp_rank_*...)
        hybrid_rank{r}.pt        rank r's own state: RNG states, the rollback snapshot mid-Predict-run
        hybrid_manifest.json     written last: world size, ZeRO stage, model, every file with its size,
                                 XXH3-64 digest of its content and the rank that wrote it
      .staging-<tag>/            a save in progress; removed by the next save of that tag
      .replaced-<tag>/           the previous <tag> for the moment a re-save of the same tag swaps folders

State every rank shares (phase controller, predictor, pending Predict steps,
statistics, ``micro_steps``) travels in DeepSpeed's ``client_state`` under the
one key ``STATE_KEY``, so it also survives DeepSpeed's universal-checkpoint
conversion. Per-rank state has its own file because on ZeRO 0-2 only rank 0
writes DeepSpeed's model-states file.

Atomicity: every rank writes into ``.staging-<tag>``; after a barrier rank 0
writes the manifest, fsyncs, renames the folder to ``<tag>`` and only then
replaces ``latest`` (write a temporary file, fsync, ``os.replace``). A process
killed at any point leaves ``latest`` naming a complete checkpoint. This
assumes ``save_dir`` is one file system that all ranks see (one node, or a
shared file system), as DeepSpeed's own ``latest`` file does.

Content: each rank takes the XXH3-64 digest (``xxhash``) of every file it writes while it
writes it: DeepSpeed's files (when its checkpoint engine is the stock ``TorchCheckpointEngine``)
and ``hybrid_rank{r}.pt`` go through ``HashingWriter``, which feeds every chunk ``torch.save``
writes to the hasher on its way to the file, so nothing is read back. Files written any other
way are hashed by reading them back after the save (``digest_file``): those of any other
checkpoint engine, and on rank 0 whatever else DeepSpeed put in the folder (its copied
``zero_to_fp32.py``). Rank 0 gathers the digests into the manifest. A load recomputes them
before DeepSpeed reads anything, so a file changed after the save (even at the same size) fails
naming the file and the rank that wrote it. Manifests of earlier saves hold CRC-32s
(``"crc32"``); they are still checked, with CRC-32. ``load_checkpoint(..., verify=False)`` skips
the digests and accepts a folder with no manifest (a plain DeepSpeed checkpoint), with a warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import zlib
from concurrent.futures import ThreadPoolExecutor
import json
import logging
import os
import random
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import xxhash

from . import nvme_resume

logger = logging.getLogger(__name__)

STATE_KEY = "ds_hybrid"
RANK_FILE = "hybrid_rank{rank}.pt"
MANIFEST_FILE = "hybrid_manifest.json"
LATEST_FILE = "latest"
STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"
FORMAT_VERSION = 1
DIGEST_KEY = "xxh3_64"                                       # the manifest key of new saves' digests
DIGEST_LABELS = {DIGEST_KEY: "XXH3-64", "crc32": "CRC-32"}   # checked on load; "crc32": saves before xxh3


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file at fault."""


# --------------------------------------------------------------------------- small file helpers


def _barrier() -> None:
    """Every rank waits here (a no-op without a process group)."""
    import deepspeed.comm as dist
    if dist.is_initialized():
        dist.barrier()


def params_finite(engine: Any) -> bool:
    """This rank's weights are finite (ZeRO 3: its partition of each parameter)."""
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)
        t = p if t is None else t
        if t.numel() and not bool(torch.isfinite(t.detach()).all()):
            return False
    return True


def _finite_on_every_rank(engine: Any) -> bool:
    """Collective: this rank's weights and last shared loss are finite, and so are every other rank's."""
    ok = params_finite(engine)
    loss = getattr(engine, "_boundary_loss", None)
    ok = ok and (loss is None or bool(torch.isfinite(torch.tensor(float(loss)))))
    import deepspeed.comm as dist
    if dist.is_initialized():
        from deepspeed.accelerator import get_accelerator
        flag = torch.tensor([0.0 if ok else 1.0], device=get_accelerator().current_device_name())
        dist.all_reduce(flag)
        ok = float(flag.item()) == 0.0
    return ok


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') data to disk: a rename is only
    durable once what it points at is."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``; readers see the old or the new file, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _read_blocks(path: Path, chunk: int = 16 << 20) -> Iterator[memoryview]:
    buf = bytearray(chunk)   # one buffer read into: no 16 MiB allocation (and mmap) per block
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            yield view[:n]


def crc32_file(path: Path) -> str:
    """CRC-32 of a file's content, hex: what manifests written before XXH3-64 hold (zlib's,
    about 2-4 GB/s per core here)."""
    crc = 0
    for block in _read_blocks(path):
        crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def new_hasher() -> Any:
    """The content digest of new saves: XXH3-64 (about 15 GB/s per core here, against CRC-32's 2-4)."""
    return xxhash.xxh3_64()


def digest_file(path: Path) -> str:
    """XXH3-64 of a file's content, hex, read back from the file (the load check; and at save time
    the fallback for a file that was not hashed while it was written)."""
    h = new_hasher()
    for block in _read_blocks(path):
        h.update(block)
    return h.hexdigest()


FILE_DIGESTS: dict[str, Callable[[Path], str]] = {DIGEST_KEY: digest_file, "crc32": crc32_file}


class HashingWriter:
    """A binary file object for ``torch.save`` that hashes what it writes, in order, on its way to ``fh``.

    ``torch.save`` to a file object (zip format) calls only ``write``, sequentially: the digest is
    then that of the file's bytes, without reading the file back. Large writes (a whole tensor's
    storage) go through in 1 MiB pieces, each hashed just before it is written, so the write's copy
    finds it in the CPU cache. A ``seek`` (``torch.serialization.skip_data`` writes holes that way)
    makes ``hexdigest()`` return None: the caller then reads the file back. It has no ``fileno``, so
    the legacy (non-zip) format cannot bypass it either.
    """

    PIECE = 1 << 20

    def __init__(self, fh: Any):
        self._fh = fh
        self._hasher = new_hasher()
        self._sequential = True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        n = len(view)
        if n <= self.PIECE:
            self._hasher.update(view)
            self._fh.write(view)
        else:
            for at in range(0, n, self.PIECE):
                piece = view[at:at + self.PIECE]
                self._hasher.update(piece)
                self._fh.write(piece)   # a BufferedWriter: writes all of it or raises
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._sequential = False
        return self._fh.seek(offset, whence)

    def tell(self) -> int:
        return self._fh.tell()

    def flush(self) -> None:
        self._fh.flush()

    def writable(self) -> bool:
        return True

    def hexdigest(self) -> str | None:
        """The digest of everything written, or None after a ``seek`` (not known without a read-back)."""
        return self._hasher.hexdigest() if self._sequential else None


def _save_hashing(obj: Any, fh: Any, **save_kwargs: Any) -> str | None:
    writer = HashingWriter(fh)
    torch.save(obj, writer, **save_kwargs)
    return writer.hexdigest()


def torch_save_hashed(obj: Any, path: str | os.PathLike, **save_kwargs: Any) -> str | None:
    """``torch.save(obj, path)``, hashing the bytes while they are written; returns their digest
    (None: hash the file by reading it back). The zip archive's inner folder is named ``archive``
    (torch's name for a file object) instead of after the file; ``torch.load`` does not care."""
    with open(path, "wb") as fh:
        return _save_hashing(obj, fh, **save_kwargs)


def torch_save_atomic(obj: Any, path: Path) -> str | None:
    """``torch.save`` into a temporary name, fsync, rename; returns the XXH3-64 of the content,
    taken while it was written (None if it could not be: see ``HashingWriter``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        digest = _save_hashing(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return digest


def validate_tag(tag: Any) -> str:
    """A tag is one folder name; the staging prefixes are ours."""
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or os.sep in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r}: must be a plain folder name (no '/', not starting with '.')")
    return tag


# --------------------------------------------------------------------------- per-rank RNG state


def rng_state() -> dict:
    """This process's random number generators: Python, NumPy, torch CPU and CUDA (when present)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional; nothing of ours draws from it
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (generators missing on either side are left alone)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        try:
            import numpy as np
            np.random.set_state(state["numpy"])
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:  # a different GPU count: this rank's device only
            torch.cuda.set_rng_state(cuda_states[torch.cuda.current_device() % len(cuda_states)])


# --------------------------------------------------------------------------- identity and manifest


def model_signature(module: torch.nn.Module) -> list[list]:
    """``[name, shape]`` of every parameter; ZeRO 3 parameters report their full shape."""
    return [[name, list(getattr(p, "ds_shape", p.shape))] for name, p in module.named_parameters()]


def run_identity(engine: Any) -> dict:
    """What a checkpoint must share with the engine loading it (unless it is a universal checkpoint)."""
    signature = model_signature(engine.module)
    return {
        "world_size": int(engine.dp_world_size),
        "zero_stage": int(engine.zero_optimization_stage()),
        "parameters": sum(int(torch.Size(shape).numel()) for _, shape in signature),
        "signature_sha256": hashlib.sha256(json.dumps(signature).encode()).hexdigest(),
        "signature": signature,
    }


@contextlib.contextmanager
def _shadowed(obj: Any, name: str, value: Any) -> Iterator[None]:
    """``obj.name`` is ``value`` for this block only (an instance attribute shadows the method); one
    the caller had set on the instance before is put back after."""
    before = vars(obj).get(name, _shadowed)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is _shadowed:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


def _hashes_while_writing(checkpoint_engine: Any) -> bool:
    """The checkpoint engine is DeepSpeed's stock ``TorchCheckpointEngine``, its ``save`` not replaced:
    ``torch_save_hashed`` then writes exactly what its ``save`` would (``torch.save`` of the state dict,
    in its serialization format), only through a ``HashingWriter``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return (type(checkpoint_engine) is TorchCheckpointEngine and "save" not in vars(checkpoint_engine)
            and hasattr(checkpoint_engine, "zipfile_serialization"))


@contextlib.contextmanager
def records_writes(checkpoint_engine: Any, written: dict) -> Iterator[None]:
    """While DeepSpeed saves: ``written[path]`` for every file its checkpoint engine writes on this rank,
    the file's XXH3-64 taken while it was written (stock ``TorchCheckpointEngine``), or None where it was
    written some other way (another checkpoint engine, or a replaced ``save``): ``_digest_own_files``
    reads those back after the save."""
    original = checkpoint_engine.save
    hashing = _hashes_while_writing(checkpoint_engine)

    def save(state_dict, path, *args, **kwargs):
        if hashing and not args and not kwargs:
            written[Path(path)] = torch_save_hashed(
                state_dict, path, _use_new_zipfile_serialization=checkpoint_engine.zipfile_serialization)
            return None
        out = original(state_dict, path, *args, **kwargs)
        written[Path(path)] = None
        return out

    with _shadowed(checkpoint_engine, "save", save):
        yield


def _digest_own_files(folder: Path, written: dict[Path, str | None], rank: int) -> dict[str, dict]:
    """``{relative path: {xxh3_64, rank}}`` of these files: the digest taken while writing, or (None)
    one read back from the file now."""
    written = {p: d for p, d in written.items() if p.is_file()}
    for p, d in written.items():
        if d is None:
            written[p] = digest_file(p)
    return {p.relative_to(folder).as_posix(): {DIGEST_KEY: d, "rank": rank} for p, d in written.items()}


def _gather_to_rank0(digests: dict) -> dict:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return digests
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, digests)
    merged: dict = {}
    for d in everyone:
        merged.update(d)
    return merged


def _listing(folder: Path) -> dict[str, int]:
    """Every file under ``folder`` (recursive: NVMe offload adds sub-folders) with its size."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}


def write_manifest(folder: Path, identity: dict, extra: dict, digests: dict | None = None) -> None:
    """Fsync every file of the finished staging folder, then write the manifest listing them
    with their size and XXH3-64 (``digests``: those the ranks took of their own files; rank 0
    reads back and digests any other file, e.g. DeepSpeed's copied ``zero_to_fp32.py``)."""
    digests = dict(digests or {})
    sizes = _listing(folder)
    missing = {folder / rel: None for rel in sizes if rel not in digests}
    digests.update(_digest_own_files(folder, missing, 0))
    files = {}
    for rel, size in sizes.items():
        _fsync_path(folder / rel)
        files[rel] = {"size": size, **digests[rel]}
    manifest = {"format": FORMAT_VERSION, **extra, **identity, "files": files}
    write_text_atomic(folder / MANIFEST_FILE, json.dumps(manifest, indent=1))


def _zero_family(stage: int) -> str:
    # ZeRO 1 and 2 share one file layout (partitioned optimizer state); 0 and 3 each have their own.
    return {0: "ZeRO 0", 1: "ZeRO 1/2", 2: "ZeRO 1/2", 3: "ZeRO 3"}.get(stage, f"ZeRO {stage}")


def check_compatible(manifest: dict, current: dict, manifest_path: Path) -> None:
    """Fail, naming the manifest, when the checkpoint was written by another world size, ZeRO layout or model."""
    tag_dir = manifest_path.parent
    if manifest["world_size"] != current["world_size"]:
        raise CheckpointError(
            f"{manifest_path}: saved by {manifest['world_size']} data-parallel rank(s), this run has "
            f"{current['world_size']}. Convert it first: python -m deepspeed.checkpoint.ds_to_universal "
            f"--input_folder {tag_dir} --output_folder {tag_dir}_universal --inject_missing_state, then load "
            f"tag '{tag_dir.name}_universal' with \"checkpoint\": {{\"load_universal\": true}} in the ds_config")
    if _zero_family(manifest["zero_stage"]) != _zero_family(current["zero_stage"]):
        raise CheckpointError(
            f"{manifest_path}: saved with ZeRO stage {manifest['zero_stage']}, this run uses stage "
            f"{current['zero_stage']}; convert it with ds_to_universal and load it with checkpoint.load_universal")
    if manifest["signature_sha256"] != current["signature_sha256"]:
        saved = {name: shape for name, shape in manifest["signature"]}
        here = {name: shape for name, shape in current["signature"]}
        diffs = [f"{n}: checkpoint {saved.get(n)} vs model {here.get(n)}"
                 for n in list(saved) + [n for n in here if n not in saved] if saved.get(n) != here.get(n)]
        raise CheckpointError(
            f"{manifest_path}: saved from a different model ({manifest['parameters']:,} parameters, this model has "
            f"{current['parameters']:,}); first differences: {'; '.join(diffs[:3])}")


def _check_torch_file(path: Path) -> None:
    # torch.save writes a zip archive: its central directory sits at the end of the
    # file, so a truncated file fails this cheap check before torch.load sees it.
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path}: not a complete torch checkpoint file (truncated or corrupt)")


def verify_files(tag_dir: Path, verify: bool = True, unmanifested_ok: bool = False) -> dict | None:
    """Check a checkpoint folder against its manifest: every file present, its size, and (``verify``)
    its content digest (XXH3-64; CRC-32 in manifests of earlier saves); return the manifest. No manifest: an error, unless ``unmanifested_ok`` (a
    ``ds_to_universal`` output) or not ``verify`` (a plain DeepSpeed checkpoint: loaded with a warning)."""
    if not tag_dir.is_dir():
        raise CheckpointError(f"{tag_dir}: checkpoint folder not found")
    manifest_path = tag_dir / MANIFEST_FILE
    manifest = None
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
            files = {rel: (e if isinstance(e, dict) else {"size": e}) for rel, e in manifest["files"].items()}
            sizes = {rel: int(e["size"]) for rel, e in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{manifest_path}: unreadable checkpoint manifest ({err})") from None
        for rel, size in sizes.items():
            path = tag_dir / rel
            if not path.is_file():
                raise CheckpointError(f"{path}: missing from the checkpoint (listed in {manifest_path})")
            actual = path.stat().st_size
            if actual != size:
                raise CheckpointError(f"{path}: {actual} bytes, but {size} were written (truncated or modified)")
        if verify:
            # each file by the digest its manifest entry holds (the first of FILE_DIGESTS' keys)
            check = {rel: next(k for k in FILE_DIGESTS if k in e) for rel, e in files.items()
                     if any(k in e for k in FILE_DIGESTS)}
            with ThreadPoolExecutor(max_workers=max(1, min(4, len(check)))) as pool:
                actual = dict(zip(check, pool.map(lambda rel: FILE_DIGESTS[check[rel]](tag_dir / rel), check)))
            for rel, key in check.items():
                if actual[rel] != files[rel][key]:
                    raise CheckpointError(
                        f"{tag_dir / rel}: its content is not what rank {files[rel].get('rank', '?')} wrote "
                        f"({DIGEST_LABELS[key]} {actual[rel]}, saved {files[rel][key]}): changed or damaged after "
                        "the save. Load another checkpoint (or, if a file system rewrote it knowingly, "
                        "load_checkpoint(..., verify=False))")
    elif unmanifested_ok:
        pass
    elif verify:
        raise CheckpointError(
            f"{tag_dir}: no {MANIFEST_FILE}, so nothing can be checked (its manifest was deleted, or another tool "
            "saved it). To load it unverified, as a plain DeepSpeed checkpoint: load_checkpoint(..., verify=False) "
            "or ds-hybrid train --resume --no-verify-checkpoint")
    else:
        logger.warning(f"{tag_dir}: no {MANIFEST_FILE}; loading it unverified (verify=False)")
    for path in sorted(tag_dir.glob("*.pt")):
        _check_torch_file(path)
    return manifest


@contextlib.contextmanager
def loads_name_their_file(checkpoint_engine: Any) -> Iterator[None]:
    """While DeepSpeed loads, an unreadable file raises a ``CheckpointError`` that names it."""
    original = checkpoint_engine.load

    def load(path, *args, **kwargs):
        try:
            return original(path, *args, **kwargs)
        except Exception as err:
            raise CheckpointError(f"{path}: cannot be loaded ({type(err).__name__}: {err})") from err

    with _shadowed(checkpoint_engine, "load", load):
        yield


# --------------------------------------------------------------------------- save


def publish(save_dir: Path, tag: str, save_latest: bool) -> None:
    """Rank 0: rename the finished staging folder to ``tag``, then point ``latest`` at it."""
    staging, final, replaced = save_dir / (STAGING_PREFIX + tag), save_dir / tag, save_dir / (REPLACED_PREFIX + tag)
    if final.exists():  # a re-save of the same tag: keep the old one until the new one is in place
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(staging, final)
    _fsync_path(save_dir)
    if save_latest:
        write_text_atomic(save_dir / LATEST_FILE, tag)
    shutil.rmtree(replaced, ignore_errors=True)


def save_atomic(engine: Any, deepspeed_save: Callable[..., Any], save_dir: str | os.PathLike, tag: Any,
                client_state: dict, save_latest: bool, exclude_frozen_parameters: bool) -> Path:
    """DeepSpeed's save into a staging folder, plus our shared and per-rank state, then publish.

    Collective: every rank calls it with the same ``tag``. Returns the checkpoint folder.
    """
    if not save_dir:
        # DeepSpeed's own check, before any rank writes anything: Path("") would save into the
        # current directory, and a rank that fails alone would leave the others in a barrier.
        raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
    if STATE_KEY in client_state:
        raise ValueError(f"save_checkpoint: client_state key '{STATE_KEY}' is reserved for ds_hybrid's own state")
    save_dir = Path(save_dir)
    tag = validate_tag(tag if tag is not None else f"global_step{engine.global_steps}")
    # `latest` must only ever name a good state: finite weights and last loss on every rank.
    finite = _finite_on_every_rank(engine)
    staging_tag = STAGING_PREFIX + tag
    staging = save_dir / staging_tag
    if _is_rank0():
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    _barrier()
    written: dict[Path, str | None] = {}   # each file this rank writes: its digest, taken while writing
    with records_writes(engine.checkpoint_engine, written):
        deepspeed_save(str(save_dir), staging_tag,
                       client_state={**client_state, STATE_KEY: engine.hybrid_state_dict()},
                       save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
    rank_file = staging / RANK_FILE.format(rank=engine.global_rank)
    written[rank_file] = torch_save_atomic(engine.rank_state_dict(), rank_file)
    digests = _digest_own_files(staging, written, int(engine.global_rank))
    digests = _gather_to_rank0(digests)
    _barrier()  # every rank's files are in staging
    if _is_rank0():
        import deepspeed
        from . import __version__
        write_manifest(staging, run_identity(engine),
                       {"tag": tag, "global_steps": int(engine.global_steps),
                        "versions": {"deepspeed": deepspeed.__version__, "ds_hybrid": __version__}}, digests)
        if save_latest and not finite:
            logger.warning(f"save_checkpoint: the weights or the last loss are not finite on some rank; "
                           f"{save_dir / tag} is written but {save_dir / LATEST_FILE} keeps naming the last good "
                           "checkpoint")
        publish(save_dir, tag, save_latest and finite)
    _barrier()  # nobody returns before the checkpoint is published
    return save_dir / tag


# --------------------------------------------------------------------------- load


def read_latest(load_dir: Path, universal: bool) -> str | None:
    """The tag DeepSpeed's ``latest`` (or ``latest_universal``) file names, or None."""
    path = load_dir / ("latest_universal" if universal else LATEST_FILE)
    if not path.is_file():
        return None
    try:
        tag = path.read_text().strip()
    except (UnicodeDecodeError, OSError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}); it should hold one checkpoint tag, "
                              "such as global_step100") from None
    if not tag:
        raise CheckpointError(f"{path}: empty (it should name a checkpoint tag)")
    if "\n" in tag or not tag.isprintable():
        raise CheckpointError(f"{path}: not a checkpoint tag ({tag[:40]!r}...); it should hold one folder name")
    try:
        return validate_tag(tag)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None


def resolve_tag_dir(load_dir: Path, tag: str) -> Path:
    """``load_dir/tag``; or, after a crash between the two renames of a re-save, the folder it was moved to."""
    final = load_dir / tag
    replaced = load_dir / (REPLACED_PREFIX + tag)
    if not final.is_dir() and replaced.is_dir():
        logger.warning(f"{final} is missing (a re-save of tag '{tag}' was interrupted); loading {replaced}")
        return replaced
    return final


def load_verified(engine: Any, deepspeed_load: Callable[..., Any], load_dir: str | os.PathLike, tag: Any,
                  load_kwargs: dict, verify: bool = True) -> tuple[str | None, dict | None]:
    """Check the files, load DeepSpeed's state, then ours. Returns DeepSpeed's ``(load_path, client_state)``
    with our key removed from ``client_state``; ``(None, None)`` when ``tag`` is None and there is no
    ``latest`` file (nothing saved yet)."""
    load_dir = Path(load_dir)
    universal = bool(engine.load_universal_checkpoint())
    from_latest = tag is None
    if from_latest:
        tag = read_latest(load_dir, universal)
        if tag is None:
            # DeepSpeed's outcome, said on every rank's log as DeepSpeed does
            logger.warning(f"load_checkpoint: no checkpoint in {load_dir} (no "
                           f"{'latest_universal' if universal else LATEST_FILE} file); nothing loaded")
            return None, None
    tag_dir = resolve_tag_dir(load_dir, str(tag))
    if from_latest and not tag_dir.is_dir():
        latest = load_dir / ("latest_universal" if universal else LATEST_FILE)
        raise CheckpointError(f"{latest} names tag '{tag}', but {tag_dir} does not exist")
    manifest = verify_files(tag_dir, verify, unmanifested_ok=universal)
    if manifest is not None and not universal:
        check_compatible(manifest, run_identity(engine), tag_dir / MANIFEST_FILE)
    try:
        with loads_name_their_file(engine.checkpoint_engine):
            load_path, client_state = deepspeed_load(str(load_dir), tag_dir.name, **load_kwargs)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError, AssertionError) as err:
        raise CheckpointError(f"{tag_dir}: DeepSpeed could not load this checkpoint ({type(err).__name__}: "
                              f"{err})") from err
    if load_path is None:
        raise CheckpointError(f"{tag_dir}: DeepSpeed found no model-states file in this checkpoint")
    if (nvme_resume.needs_restore(engine) and load_kwargs.get("load_optimizer_states", True)
            and not load_kwargs.get("load_module_only")):
        try:   # (DeepSpeed's NVMe load restores the masters, not the Adam state: nvme_resume.py)
            nvme_resume.restore_adam_state(engine, tag_dir)
        except nvme_resume.NvmeResumeError as err:
            raise CheckpointError(f"{tag_dir}: {err}") from err
    reseat_cpu_adam_kernels(engine.optimizer)
    if not params_finite(engine):
        raise CheckpointError(f"{tag_dir}: holds non-finite weights (NaN or Inf) on rank {engine.global_rank}; "
                              "resume from an earlier checkpoint")
    client_state = dict(client_state or {})
    shared = client_state.pop(STATE_KEY, None)
    if load_kwargs.get("load_module_only"):
        return load_path, client_state  # weights only: the training state starts afresh
    engine.load_hybrid_state_dict(shared, source=tag_dir)
    engine.load_rank_state_dict(_read_rank_state(tag_dir, engine.global_rank, int(engine.dp_world_size)),
                                source=tag_dir)
    return load_path, client_state


def reseat_cpu_adam_kernels(optimizer: Any) -> None:
    """Make DeepSpeed's C++ CPU Adam kernels round as they would have in the uninterrupted process.

    FusedAdam on the CPU accelerator (one cache per AdamW/Adam mode, process-wide) and
    DeepSpeedCPUAdam for ZeRO-Offload (one per optimizer) cache ``beta1**t`` and
    ``beta2**t`` for bias correction and advance the cache by one float multiplication
    per step; a fresh process computes ``pow(beta, t)`` on its first step instead, which
    differs in the last bit. Replaying steps 1..t on one-element scratch tensors puts the
    cache where an uninterrupted run has it (microseconds per step). On CUDA FusedAdam
    computes ``pow`` on every step and needs nothing.
    """
    from deepspeed.accelerator import get_accelerator
    base = getattr(optimizer, "optimizer", optimizer)
    name = type(base).__name__
    if name == "DeepSpeedCPUAdam":
        def kernel_step(t, group, scratch):
            base.ds_opt_adam.adam_update(base.opt_id, t, 0.0, *group["betas"], group["eps"], 0.0,
                                         group["bias_correction"], *scratch)
    elif name == "FusedAdam" and get_accelerator().device_name() == "cpu":
        def kernel_step(t, group, scratch):
            param, grad, exp_avg, exp_avg_sq = scratch
            base.multi_tensor_adam(1, base._dummy_overflow_buf, [[grad], [param], [exp_avg], [exp_avg_sq]], 0.0,
                                   *group["betas"], group["eps"], t, base.adam_w_mode,
                                   1 if group["bias_correction"] else 0, 0.0)
    else:
        return
    steps = [int(st["step"]) for st in base.state.values() if "step" in st]
    if not steps:
        return
    # Groups the optimizer stepped, in its own order: a group whose betas differ resets the cache.
    groups = [g for g in base.param_groups if any("step" in base.state.get(p, {}) for p in g["params"])] \
        or base.param_groups
    scratch = [torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)]
    for t in range(1, max(steps) + 1):
        for group in groups:
            kernel_step(t, group, scratch)


def _read_rank_state(tag_dir: Path, rank: int, world_size: int) -> dict | None:
    """This rank's file, or None where it does not apply (a universal checkpoint, another world size)."""
    path = tag_dir / RANK_FILE.format(rank=rank)
    if not path.is_file():
        logger.warning(f"{tag_dir}: no {path.name}; this rank's RNG states and rollback snapshot are not restored "
                       "(expected for a converted universal checkpoint)")
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own file: RNG tuples, numpy arrays
    except Exception as err:
        raise CheckpointError(f"{path}: cannot be loaded ({type(err).__name__}: {err})") from err
    if state.get("world_size") != world_size:
        logger.warning(f"{path}: written by a run of {state.get('world_size')} rank(s), this one has {world_size}; "
                       "per-rank state is not restored")
        return None
    return state
