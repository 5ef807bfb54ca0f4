"""Checkpoints that hold the whole training state and survive a kill in the middle of a save.

``PredictiveEngine.save_checkpoint`` / ``load_checkpoint`` call ``save_atomic`` /
``load_verified`` below around DeepSpeed's own save and load. What is where::

    save_dir/
      latest                     tag of the newest complete checkpoint (DeepSpeed's file);
                                 replaced atomically, and only after the tag folder is complete
      <tag>/                     DeepSpeed's files (mp_rank_00_model_states.pt, zero_pp_rank_*...)
        hybrid_rank{r}.pt        rank r's own state: RNG states, the rollback snapshot mid-Predict-run
        hybrid_manifest.json     written last: world size, ZeRO stage, model, every file with its size,
                                 CRC-32 of its content and the rank that wrote it
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

Content: each rank takes the CRC-32 of every file it wrote right after writing it (read back
from the page cache); rank 0 gathers them into the manifest. A load recomputes them before
DeepSpeed reads anything, so a file changed after the save (even at the same size) fails
naming the file and the rank that wrote it. ``load_checkpoint(..., verify=False)`` skips the
digests and accepts a folder with no manifest (a plain DeepSpeed checkpoint), with a warning.
"""
from __future__ import annotations

import contextlib
import hashlib
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

logger = logging.getLogger(__name__)

STATE_KEY = "ds_hybrid"
RANK_FILE = "hybrid_rank{rank}.pt"
MANIFEST_FILE = "hybrid_manifest.json"
LATEST_FILE = "latest"
STAGING_PREFIX = ".staging-"
REPLACED_PREFIX = ".replaced-"
FORMAT_VERSION = 1


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


def crc32_file(path: Path, chunk: int = 16 << 20) -> str:
    """CRC-32 of a file's content, hex (zlib's, about 3 GB/s per core here; it releases the GIL,
    so files are digested in parallel threads)."""
    crc, buf = 0, bytearray(chunk)   # one buffer read into: no 16 MiB allocation (and mmap) per block
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def torch_save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` into a temporary name, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
def records_writes(checkpoint_engine: Any, written: list) -> Iterator[None]:
    """While DeepSpeed saves: the path of every file its checkpoint engine writes on this rank.
    (Their CRC-32s are taken after the save: started as each file was written, they ran beside the
    writing of the next and slowed it, measured: benchmarks/checkpoint_digest_cost.py.)"""
    original = checkpoint_engine.save

    def save(state_dict, path, *args, **kwargs):
        out = original(state_dict, path, *args, **kwargs)
        written.append(Path(path))
        return out

    checkpoint_engine.save = save  # an instance attribute shadows the method for this block only
    try:
        yield
    finally:
        del checkpoint_engine.save


def _digest_own_files(folder: Path, paths: list[Path], rank: int) -> dict[str, dict]:
    """``{relative path: {crc32, rank}}`` of these files (in parallel threads)."""
    paths = [p for p in dict.fromkeys(paths) if p.is_file()]
    with ThreadPoolExecutor(max_workers=max(1, min(4, len(paths)))) as pool:
        crcs = list(pool.map(crc32_file, paths))
    return {p.relative_to(folder).as_posix(): {"crc32": c, "rank": rank} for p, c in zip(paths, crcs)}


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
    with their size and CRC-32 (``digests``: those the ranks took of their own files; rank 0
    digests any other file itself, e.g. DeepSpeed's copied scripts)."""
    digests = dict(digests or {})
    sizes = _listing(folder)
    missing = [rel for rel in sizes if rel not in digests]
    for rel, d in _digest_own_files(folder, [folder / rel for rel in missing], 0).items():
        digests[rel] = d
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
    its CRC-32; return the manifest. No manifest: an error, unless ``unmanifested_ok`` (a
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
            check = [rel for rel, e in files.items() if "crc32" in e]
            with ThreadPoolExecutor(max_workers=max(1, min(4, len(check)))) as pool:
                crcs = dict(zip(check, pool.map(lambda rel: crc32_file(tag_dir / rel), check)))
            for rel in check:
                if crcs[rel] != files[rel]["crc32"]:
                    raise CheckpointError(
                        f"{tag_dir / rel}: its content is not what rank {files[rel].get('rank', '?')} wrote (CRC-32 "
                        f"{crcs[rel]}, saved {files[rel]['crc32']}): changed or damaged after the save. Load another "
                        "checkpoint (or, if a file system rewrote it knowingly, load_checkpoint(..., verify=False))")
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

    checkpoint_engine.load = load  # an instance attribute shadows the method for this block only
    try:
        yield
    finally:
        del checkpoint_engine.load


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
    written: list[Path] = []
    with records_writes(engine.checkpoint_engine, written):
        deepspeed_save(str(save_dir), staging_tag,
                       client_state={**client_state, STATE_KEY: engine.hybrid_state_dict()},
                       save_latest=False, exclude_frozen_parameters=exclude_frozen_parameters)
    rank_file = staging / RANK_FILE.format(rank=engine.global_rank)
    torch_save_atomic(engine.rank_state_dict(), rank_file)
    digests = _digest_own_files(staging, written + [rank_file], int(engine.global_rank))
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
