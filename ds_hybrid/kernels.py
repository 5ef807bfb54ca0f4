"""CUDA kernels for the predictor's hot paths, loaded with CuPy, each beside its torch reference.

| kernel (kernels/*.cu)                   | dispatcher        | torch reference                                      |
|-----------------------------------------|-------------------|------------------------------------------------------|
| ``fused_update.cu``                     | ``fused_update``  | ``fused_update_reference`` (below; the arithmetic of ``zero_access.adam_direction`` + ``apply_predicted_update``) |
| ``fused_update.cu`` ``drift_shift``     | ``drift_shift``   | ``drift_shift_reference`` (below; ``DevicePredict``'s drift step into a 16-bit shard) |
| ``fused_update.cu`` ``held_adam_step``  | ``held_adam_step`` | ``held_adam_step_reference`` (below; a ``direction: gradient`` step into a 16-bit shard) |
| ``rssm.cu`` ``rssm_step``               | ``rssm_step``     | ``RSSMEnsemble.step`` then ``.prior``                |
| ``rssm.cu`` ``rssm_rollout``            | ``rssm_rollout``  | ``RSSMEnsemble.rollout``                             |
| ``encoder.cu`` ``window_features``      | ``window_features`` | ``dynamics.window.window_features``                |

Every dispatcher takes ``backend``: ``"torch"`` runs the reference; ``"cupy"`` runs the kernel
and fails with a ``KernelUnavailable`` naming the setting ``hybrid_predict.kernels`` and what
is missing (CuPy, a CUDA device, a CUDA tensor); ``"auto"`` (the default) runs the kernel when
CuPy imports and the tensors are on a CUDA device, else the reference. A kernel module that
cannot be built under ``"auto"`` (a CuPy without a working compiler, say) falls back to the
reference once, with a warning; under ``"cupy"`` it raises.

CuPy is optional (``pip install ds_hybrid[cuda]``, or ``cupy-cuda13x`` for a CUDA 13 driver):
it is imported on first use, never at import time. Tensors are shared with CuPy through DLPack
(no copies) and kernels are launched on torch's current CUDA stream, so they order with the
surrounding torch work. The kernels compute without autograd.

The loader reads ``kernels/NAME.cu``, prepends ``#line 1 "<absolute path>"`` so that compiler
errors point at the ``.cu`` file, builds a ``cupy.RawModule`` (NVRTC) and caches it per
(file, device, options) in the process; CuPy also keeps compiled binaries on disk
(``~/.cupy/kernel_cache``).
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.metadata
import logging
import math
import os
import threading
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch

from .dynamics.window import NUM_CHANNELS, NUM_WINDOW_FEATURES, WINDOW
from .quant import BLOCK, CompactBuffer, scratch
from .dynamics.window import window_features as window_features_reference

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cupy", "torch")
SETTING = "hybrid_predict.kernels"
# The repository's kernels/ folder (the package is installed editable); DS_HYBRID_KERNEL_DIR
# points elsewhere, for an installed copy.
KERNEL_DIR = Path(os.environ.get("DS_HYBRID_KERNEL_DIR",
                                 Path(__file__).resolve().parent.parent / "kernels"))
NVRTC_OPTIONS = ("-std=c++14",)
CUPY_PACKAGES = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")


# Kernel launches in this process, by kernel name: what a training run's summary reports as
# ``kernel_launches`` (the evidence that ``auto`` took the kernels, not the references).
LAUNCHES: collections.Counter = collections.Counter()


class KernelUnavailable(RuntimeError):
    """A kernel was asked for (``hybrid_predict.kernels: cupy``) and cannot run here."""


class KernelBuildError(RuntimeError):
    """NVRTC rejected a kernels/*.cu file; the message carries the compiler's log."""


# ---------------------------------------------------------------------------
# CuPy, lazily
# ---------------------------------------------------------------------------

_cupy_lock = threading.Lock()
_cupy_state: dict[str, Any] = {}


def cupy_packages() -> dict[str, str]:
    """CuPy distributions installed in this environment: name -> version."""
    found = {}
    for name in CUPY_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _suggested_package() -> str:
    cuda = torch.version.cuda or ""
    return "cupy-cuda13x" if cuda.startswith("13") else "cupy-cuda12x"


def import_cupy():
    """The ``cupy`` module, imported on first call; ``KernelUnavailable`` when it does not import."""
    with _cupy_lock:
        if "module" not in _cupy_state and "error" not in _cupy_state:
            try:
                _cupy_state["module"] = importlib.import_module("cupy")
            except Exception as exc:  # ImportError, or a CUDA library it cannot load
                _cupy_state["error"] = f"{type(exc).__name__}: {exc}"
    if "module" in _cupy_state:
        return _cupy_state["module"]
    raise KernelUnavailable(
        f"{SETTING}: CuPy does not import ({_cupy_state['error']}); install the one for this CUDA "
        f"(pip install {_suggested_package()}, or ds_hybrid[cuda]) or set {SETTING} to 'torch'")


def cupy_available() -> bool:
    try:
        import_cupy()
        return True
    except KernelUnavailable:
        return False


def _reset_cupy_state() -> None:
    """Forget the import result and compiled modules (tests)."""
    with _cupy_lock:
        _cupy_state.clear()
    _modules.clear()
    _fallen_back.clear()


# ---------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------

def resolve_backend(backend: str, *tensors: torch.Tensor | None) -> str:
    """``"cupy"`` or ``"torch"`` for these tensors under the setting ``backend``.

    ``auto``: cupy when CuPy imports and every tensor is on one CUDA device. ``cupy``: the same
    conditions, or ``KernelUnavailable`` naming what is missing.
    """
    return _resolve_for(backend, {t.device for t in tensors if t is not None})


def _resolve_for(backend: str, devices: set[torch.device]) -> str:
    """``resolve_backend`` for tensors on ``devices``."""
    if backend not in BACKENDS:
        raise ValueError(f"{SETTING}: expected one of {', '.join(BACKENDS)} (got {backend!r})")
    if backend == "torch":
        return "torch"
    on_one_gpu = len(devices) == 1 and next(iter(devices)).type == "cuda"
    if backend == "auto":
        return "cupy" if on_one_gpu and cupy_available() else "torch"
    if not torch.cuda.is_available():
        raise KernelUnavailable(f"{SETTING} is 'cupy' but torch sees no CUDA device "
                                f"(torch {torch.__version__}); set it to 'auto' or 'torch'")
    if not on_one_gpu:
        raise KernelUnavailable(f"{SETTING} is 'cupy' but the tensors are on "
                                f"{sorted(str(d) for d in devices) or 'no device'}: the kernels need "
                                f"them on one CUDA device")
    import_cupy()
    return "cupy"


# ---------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------

_modules: dict[tuple, Any] = {}
_fallen_back: set[tuple[str, int | None]] = set()   # (kernel, device) that 'auto' gave up on


def kernel_path(name: str) -> Path:
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise KernelUnavailable(f"{SETTING}: kernel source {path} not found (set DS_HYBRID_KERNEL_DIR to the "
                                f"repository's kernels/ folder)")
    return path


def kernel_source(name: str) -> str:
    """``kernels/NAME.cu`` with a ``#line`` directive, so compiler errors name the file and line."""
    path = kernel_path(name).resolve()
    return f'#line 1 "{path}"\n' + path.read_text()


def load_module(name: str, name_expressions: Iterable[str] = (), options: Iterable[str] = NVRTC_OPTIONS,
                device: int | None = None):
    """The compiled ``cupy.RawModule`` of ``kernels/NAME.cu`` for ``device`` (the current one by default).

    Cached per (file, device, options, name expressions) for the life of the process (an edited
    ``.cu`` is picked up by the next process; CuPy's disk cache is keyed by the source itself).
    Compilation happens here, so a bad kernel fails with ``KernelBuildError`` carrying NVRTC's
    log (pointing at the file).
    """
    cp = import_cupy()
    options, names = tuple(options), tuple(name_expressions)
    dev = cp.cuda.runtime.getDevice() if device is None else int(device)
    key = (str(KERNEL_DIR / f"{name}.cu"), dev, options, names)
    mod = _modules.get(key)   # the hot path: no file access
    if mod is not None:
        return mod
    source = kernel_source(name)
    with cp.cuda.Device(dev):
        mod = cp.RawModule(code=source, options=options, name_expressions=names or None)
        try:
            mod.compile()
        except Exception as exc:
            log_text = getattr(exc, "get_message", lambda: str(exc))()
            raise KernelBuildError(f"compiling {kernel_path(name)} for device {dev} failed:\n{log_text}") from exc
    _modules[key] = mod
    return mod


def _module_or_fallback(name: str, backend: str, device: torch.device, name_expressions: Iterable[str] = ()):
    """The module for ``device``, or None when ``auto`` should fall back to torch because it cannot be
    built (decided once per kernel and device, with one warning)."""
    if backend != "cupy" and (name, device.index) in _fallen_back:
        return None
    try:
        return load_module(name, name_expressions, device=device.index)
    except (KernelBuildError, KernelUnavailable, OSError, RuntimeError) as exc:
        if backend == "cupy":
            raise
        if (name, device.index) not in _fallen_back:
            _fallen_back.add((name, device.index))
            log.warning("ds_hybrid: kernels/%s.cu could not be built (%s); %s 'auto' uses the torch "
                        "reference instead", name, str(exc).splitlines()[0], SETTING)
        return None


def prebuild(backend: str, device: torch.device) -> bool:
    """Compile ``kernels/fused_update.cu`` (every kernel a training step launches: the fused update,
    ``drift_shift``, ``held_adam_step``, ``shard_fold``) for ``device`` now, so that NVRTC's first
    build is set-up time rather than the first Predict step's (5.7 s of a llama-1b Predict step on an
    H200 with an empty CuPy disk cache, 2026-11-30; a later process reads that cache, about 0.2 s).
    True when the module is ready; False where the steps will use the torch reference (``torch``,
    a device that is not CUDA, or ``auto`` without CuPy or a build); ``cupy`` raises as a launch would."""
    if device.type != "cuda" or _resolve_for(backend, {device}) != "cupy":
        return False
    return _module_or_fallback("fused_update", backend, device, FUSED_UPDATE_MODULE) is not None


@contextlib.contextmanager
def _on_torch_stream(device: torch.device):
    """CuPy's current device and stream = torch's, for launches and DLPack exchanges."""
    cp = import_cupy()
    stream = torch.cuda.current_stream(device)
    with cp.cuda.Device(device.index), cp.cuda.ExternalStream(stream.cuda_stream, device.index):
        yield cp


def _cp(t: torch.Tensor):
    """A CuPy view of a contiguous CUDA tensor (DLPack, no copy). bf16/fp16 as 16-bit integers."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return import_cupy().from_dlpack(t.detach())


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------
# 1. Fused predicted update
# ---------------------------------------------------------------------------

_LP_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2}
FUSED_UPDATE_NAMES = tuple(f"fused_predicted_update<{lp},{snap},{sq},{vec}>"
                           for lp in (0, 1, 2) for snap in ("true", "false")
                           for sq in ("true", "false") for vec in ("true", "false"))
FUSED_UPDATE_THREADS = 256


def _bias_corrections(beta1: float, beta2: float, step: float, bias_correction: bool) -> tuple[float, float]:
    if step < 1:
        raise RuntimeError("ds_hybrid: the optimizer state has no step count; a Predict step needs at "
                           "least one real optimizer step first (hybrid_predict.warmup_steps >= 1)")
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


def _check_update_args(master, exp_avg, exp_avg_sq, lp_out, snapshot_out) -> None:
    if master.dtype != torch.float32:
        raise TypeError(f"fused_update: master must be float32 (got {master.dtype})")
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.shape != master.shape or t.dtype != torch.float32:
            raise ValueError(f"fused_update: {name} must be float32 of master's shape {tuple(master.shape)} "
                             f"(got {t.dtype} {tuple(t.shape)})")
    if lp_out is not None and (lp_out.dtype not in (torch.bfloat16, torch.float16)
                               or lp_out.numel() != master.numel()):
        raise ValueError(f"fused_update: lp_out must be bfloat16 or float16 with {master.numel()} elements "
                         f"(got {lp_out.dtype} with {lp_out.numel()})")
    if snapshot_out is not None and (snapshot_out.dtype != torch.float32 or snapshot_out.numel() != master.numel()):
        raise ValueError(f"fused_update: snapshot_out must be float32 with {master.numel()} elements")


def _fused_module(backend: str, choice: str, fits: bool, device: torch.device, need: str):
    """``kernels/fused_update.cu``'s module for a dispatcher whose tensors resolved to ``choice``,
    or None for its torch reference: where they do not fit the kernel (``need`` says what it needs,
    raised under ``cupy``) or ``auto`` cannot build it."""
    if choice != "cupy":
        return None
    if not fits:
        if backend == "cupy":
            raise ValueError(need)
        return None
    return _module_or_fallback("fused_update", backend, device, FUSED_UPDATE_MODULE)


@torch.no_grad()
def fused_update_reference(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                           lr: float, scale: float, beta1: float, beta2: float, eps: float, step: float,
                           weight_decay: float, decoupled: bool, bias_correction: bool = True,
                           lp_out: torch.Tensor | None = None, snapshot_out: torch.Tensor | None = None,
                           compute_sq: bool = False) -> torch.Tensor | None:
    """The predicted update of one flat fp32 master partition, in place (torch reference).

    ``master += -scale * lr * (m / bc1) / (sqrt(v / bc2) + eps) - (lr * wd * master if decoupled)``
    with ``bc = 1 - beta ** step`` (1 when ``bias_correction`` is off): the same operations, in
    the same order, as ``zero_access.adam_direction`` + ``apply_predicted_update``, so on one
    device the result is bit-identical to theirs. ``snapshot_out`` receives the master before
    the update (the rollback point); ``lp_out`` the new master rounded to its dtype (bf16 /
    fp16, the model's copy). Returns the squared norm of the update as a 0-dim float64 tensor
    on master's device when ``compute_sq`` (no host sync), else None.

    Like ``apply_predicted_update``, callers skip a partition whose scale is 0 (its decay too).
    """
    _check_update_args(master, exp_avg, exp_avg_sq, lp_out, snapshot_out)
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    kw = dict(bc1=bc1, bc2=bc2, eps=eps, step_lr=-scale * lr,
              decay=-lr * weight_decay if decoupled and weight_decay else 0.0)
    sq = torch.zeros((), dtype=torch.float64, device=master.device) if compute_sq else None
    if not (master.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous()):
        _update_span(master, exp_avg, exp_avg_sq, None if snapshot_out is None else snapshot_out.view(master.shape),
                     None if lp_out is None else lp_out.view(master.shape), sq, **kw)
        return sq
    # Flat partitions: a chunk at a time through two reused work buffers (whole-partition
    # temporaries cost GBs and page faults on a host partition).
    from .quant import CHUNK, scratch
    w0, w1 = scratch(master.device, 0, master.numel()), scratch(master.device, 1, master.numel())
    m, ea, eas = master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1)
    snap = snapshot_out.view(-1) if snapshot_out is not None else None
    lp = lp_out.view(-1) if lp_out is not None else None
    for s in range(0, m.numel(), CHUNK):
        e = min(s + CHUNK, m.numel())
        _update_span(m[s:e], ea[s:e], eas[s:e], None if snap is None else snap[s:e], None if lp is None else lp[s:e],
                     sq, w0=w0[:e - s], w1=w1[:e - s], **kw)
    return sq


def _update_span(master, exp_avg, exp_avg_sq, snapshot, lp, sq, *, bc1, bc2, eps, step_lr, decay, w0=None, w1=None):
    """The reference arithmetic on one span (a chunk, or a whole non-contiguous tensor), in place;
    ``w0`` / ``w1``: work buffers of the span's size (None: allocate)."""
    if snapshot is not None:
        snapshot.copy_(master)
    denom = torch.div(exp_avg_sq, bc2, out=w0).sqrt_().add_(eps)
    update = torch.div(exp_avg, bc1, out=w1).div_(denom).mul_(step_lr)
    if decay:
        update.add_(master, alpha=decay)
    if sq is not None:   # fp32 squares summed in fp64 (within 1e-7 of squaring in fp64)
        sq += torch.mul(update, update, out=w0).sum(dtype=torch.float64)
    master.add_(update)
    if lp is not None:
        lp.copy_(master)


def _fused_update_cupy(master, exp_avg, exp_avg_sq, *, lr, scale, beta1, beta2, eps, step, weight_decay,
                       decoupled, bias_correction, lp_out, snapshot_out, compute_sq, mod):
    n = master.numel()
    dev = master.device
    sq = torch.zeros((), dtype=torch.float64, device=dev) if compute_sq else None
    if n == 0:
        return sq
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    ptrs = [master, exp_avg, exp_avg_sq] + ([snapshot_out] if snapshot_out is not None else [])
    vec = all(t.data_ptr() % 16 == 0 for t in ptrs) and (lp_out is None or lp_out.data_ptr() % 8 == 0)
    lp = _LP_CODES[None if lp_out is None else lp_out.dtype]
    b = lambda flag: "true" if flag else "false"  # noqa: E731
    work = (n + 3) // 4 if vec else n
    blocks = max(1, min(math.ceil(work / FUSED_UPDATE_THREADS), 16 * _sm_count(dev)))
    with _on_torch_stream(dev) as cp:
        fn = mod.get_function(f"fused_predicted_update<{lp},{b(snapshot_out is not None)},{b(compute_sq)},{b(vec)}>")
        m = _cp(master)
        args = (m, _cp(exp_avg), _cp(exp_avg_sq),
                _cp(lp_out) if lp_out is not None else m,        # unused pointer when absent
                _cp(snapshot_out) if snapshot_out is not None else m,
                _cp(sq) if sq is not None else m,
                cp.int64(n), cp.float32(-scale * lr), cp.float32(bc1), cp.float32(bc2), cp.float32(eps),
                cp.float32(-lr * weight_decay if decoupled and weight_decay else 0.0))
        fn((blocks,), (FUSED_UPDATE_THREADS,), args)
    LAUNCHES["fused_update"] += 1
    return sq


def fused_update(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                 lr: float, scale: float, beta1: float, beta2: float, eps: float, step: float,
                 weight_decay: float, decoupled: bool, bias_correction: bool = True,
                 lp_out: torch.Tensor | None = None, snapshot_out: torch.Tensor | None = None,
                 compute_sq: bool = False, backend: str = "auto") -> torch.Tensor | None:
    """``fused_update_reference`` in one pass over memory (``kernels/fused_update.cu``) or in torch.

    The kernel reads master, exp_avg and exp_avg_sq once and writes the master, ``lp_out`` and
    ``snapshot_out`` in the same pass. A ``snapshot_out`` that is not on master's device (the
    ``snapshot_device: cpu`` case) is filled by a copy before the kernel. Non-contiguous
    tensors take the torch path.
    """
    kw = dict(lr=lr, scale=scale, beta1=beta1, beta2=beta2, eps=eps, step=step, weight_decay=weight_decay,
              decoupled=decoupled, bias_correction=bias_correction, compute_sq=compute_sq)
    _check_update_args(master, exp_avg, exp_avg_sq, lp_out, snapshot_out)
    off_device_snapshot = snapshot_out is not None and snapshot_out.device != master.device
    tensors = (master, exp_avg, exp_avg_sq, lp_out, None if off_device_snapshot else snapshot_out)
    choice = resolve_backend(backend, *tensors)
    mod = _fused_module(backend, choice, all(t.is_contiguous() for t in tensors if t is not None), master.device,
                        "fused_update: the kernel needs contiguous tensors (flat partitions)")
    if mod is None:
        return fused_update_reference(master, exp_avg, exp_avg_sq, lp_out=lp_out, snapshot_out=snapshot_out, **kw)
    if off_device_snapshot:
        snapshot_out.view(master.shape).copy_(master, non_blocking=True)
        snapshot_out = None
    return _fused_update_cupy(master, exp_avg, exp_avg_sq, lp_out=lp_out, snapshot_out=snapshot_out, mod=mod,
                              **kw)


@torch.no_grad()
def held_adam_step_reference(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
                             beta2: float, eps: float, step: float, weight_decay: float, decoupled: bool,
                             bias_correction: bool = True, key: int = 0) -> None:
    """Adam's step on one flat shard ``x`` from its first moment ``m`` (which already holds the
    step's gradient) and a second moment ``v`` held from the last real step, in place (torch
    reference): ``x += -lr * (m / bc1) / (sqrt(v / bc2) + eps) - lr * wd * x``, the operations of
    ``fused_update_reference`` in fp32 with each operand widened first, a chunk at a time. A bf16
    ``x`` is written back rounded stochastically (``quant.stochastic_round_bf16_`` with the random
    bits of (``key``, index in ``x``)): an Adam step is often under half a bf16 step of the weight
    it moves, and round to nearest would drop it."""
    from .quant import CHUNK, stochastic_round_bf16_
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    decay = -lr * weight_decay if decoupled and weight_decay else 0.0
    xs, ms, vs = x.view(-1), m.view(-1), v.view(-1)
    w0, w1 = scratch(x.device, 0, xs.numel()), scratch(x.device, 1, xs.numel())
    w2 = scratch(x.device, 2, xs.numel())
    for a in range(0, xs.numel(), CHUNK):
        b = min(a + CHUNK, xs.numel())
        n = b - a
        denom = w0[:n].copy_(vs[a:b]).div_(bc2).sqrt_().add_(eps)
        update = w1[:n].copy_(ms[a:b]).div_(bc1).div_(denom).mul_(-lr)
        if x.dtype == torch.float32:
            if decay:
                update.add_(xs[a:b], alpha=decay)
            xs[a:b].add_(update)
            continue
        w = w2[:n].copy_(xs[a:b])
        if decay:
            update.add_(w, alpha=decay)
        stochastic_round_bf16_(xs[a:b], w.add_(update), key, start=a)


def held_adam_step(x: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                   eps: float, step: float, weight_decay: float, decoupled: bool, bias_correction: bool = True,
                   key: int = 0, backend: str = "auto") -> None:
    """``held_adam_step_reference`` (a ``predictor.direction: gradient`` step on the device path,
    ``grad_predict.GradientPredict``) in one pass (``kernels/fused_update.cu``'s
    ``held_adam_step<X,S>``: x read and written, m and v read, 8 bytes per element in bf16 where
    the torch ops move about 100) or in torch. ``x`` fp32 or bf16, ``m`` and ``v`` fp32 or bf16,
    all flat and of one length on one device. With all three fp32 it is ``fused_update`` at scale 1
    (kernel or reference), bit for bit the host path's update of the masters."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"held_adam_step: x must be float32 or bfloat16 (got {x.dtype})")
    kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, weight_decay=weight_decay, decoupled=decoupled,
              bias_correction=bias_correction)
    if x.dtype == m.dtype == v.dtype == torch.float32:
        fused_update(x, m, v, scale=1.0, backend=backend, **kw)
        return
    choice = resolve_backend(backend, x, m, v)
    fits = (all(t.is_contiguous() and t.dtype in _HELD_CODES for t in (x, m, v)) and m.dtype == v.dtype
            and x.numel() == m.numel() == v.numel())
    mod = _fused_module(backend, choice, fits, x.device, "held_adam_step: the kernel needs contiguous fp32/bf16 x, "
                                                          "m and v of one length (m and v of one dtype)")
    if mod is None:
        return held_adam_step_reference(x, m, v, key=key, **kw)
    n = x.numel()
    if n == 0:
        return None
    bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
    decay = -lr * weight_decay if decoupled and weight_decay else 0.0
    blocks = max(1, min(math.ceil(n / FUSED_UPDATE_THREADS), 16 * _sm_count(x.device)))
    with _on_torch_stream(x.device) as cp:
        fn = mod.get_function(f"held_adam_step<{_HELD_CODES[x.dtype]},{_HELD_CODES[m.dtype]}>")
        fn((blocks,), (FUSED_UPDATE_THREADS,), (_cp(x), _cp(m), _cp(v), cp.int64(n), cp.float32(-lr),
                                                 cp.float32(bc1), cp.float32(bc2), cp.float32(eps),
                                                 cp.float32(decay), cp.uint32(int(key) & 0xFFFFFFFF)))
    LAUNCHES["held_adam_step"] += 1
    return None


_X_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_VD_CODES = {"fp32": 0, "bf16": 1, "int8": 2}
DRIFT_SHIFT_NAMES = tuple(f"drift_shift<{x},{vd},{vec}>" for x in (0, 1, 2) for vd in (0, 1, 2)
                          for vec in ("true", "false"))
_HELD_CODES = {torch.float32: 0, torch.bfloat16: 1}
HELD_ADAM_NAMES = tuple(f"held_adam_step<{x},{s}>" for x in (0, 1) for s in (0, 1))
SHARD_FOLD_NAMES = tuple(f"shard_fold<{x},{vd},{mom}>" for x in (0, 1, 2) for vd in (0, 1, 2)
                         for mom in ("true", "false"))
SHARD_FOLD_THREADS = 256   # kernels/fused_update.cu's DSH_FOLD_THREADS: one int8 block a thread block
# Every name expression of kernels/fused_update.cu: one module serves the four dispatchers.
FUSED_UPDATE_MODULE = FUSED_UPDATE_NAMES + DRIFT_SHIFT_NAMES + HELD_ADAM_NAMES + SHARD_FOLD_NAMES
assert BLOCK == 256, "kernels/fused_update.cu's drift_shift reads one int8 scale per 256 values"


@torch.no_grad()
def drift_shift_reference(x: torch.Tensor, buf: CompactBuffer, coefs: "list[float]") -> None:
    """The device path's drift steps into a flat shard ``x`` (``device_predict.DevicePredict``):
    ``x += c * v`` for each ``c`` in order (zeros skipped), ``v`` the velocity ``buf`` on x's
    device, a chunk at a time. A 16-bit ``x`` is widened into an fp32 work chunk and copied back
    after every step, so each step rounds it as the weights were rounded."""
    work, acc = scratch(x.device, 0, x.numel()), scratch(x.device, 1, x.numel())
    for a, b in buf.chunks():
        v = buf.data[a:b] if buf.dtype == "fp32" else buf.load(a, b, out=work)
        if x.dtype == torch.float32:
            for c in coefs:
                if c != 0.0:
                    x[a:b].add_(v, alpha=c)
            continue
        w = acc[:b - a]
        for c in coefs:
            if c != 0.0:
                w.copy_(x[a:b]).add_(v, alpha=c)
                x[a:b].copy_(w)


def drift_shift(x: torch.Tensor, buf: CompactBuffer, coefs: "list[float]", backend: str = "auto") -> None:
    """``drift_shift_reference`` in one pass per step (``kernels/fused_update.cu``'s
    ``drift_shift``: ``x`` read and written once, the velocity read once) or in torch. ``x``: a flat
    contiguous fp32 / bf16 / fp16 shard with as many values as ``buf``, on one CUDA device with it."""
    scale = buf.scale if buf.dtype == "int8" else None
    choice = resolve_backend(backend, x, buf.data, scale)
    mod = _fused_module(backend, choice, x.is_contiguous() and x.dtype in _X_CODES and x.numel() == buf.numel,
                        x.device, "drift_shift: the kernel needs a contiguous fp32/bf16/fp16 shard as long as "
                                  "the velocity")
    if mod is None:
        return drift_shift_reference(x, buf, coefs)
    n = x.numel()
    steps = [float(c) for c in coefs if c != 0.0]
    if n == 0 or not steps:
        return None
    vec = x.data_ptr() % (4 * x.element_size()) == 0 and buf.data.data_ptr() % (4 * buf.data.element_size()) == 0
    work = (n + 3) // 4 if vec else n
    blocks = max(1, min(math.ceil(work / FUSED_UPDATE_THREADS), 16 * _sm_count(x.device)))
    with _on_torch_stream(x.device) as cp:
        fn = mod.get_function(f"drift_shift<{_X_CODES[x.dtype]},{_VD_CODES[buf.dtype]},{'true' if vec else 'false'}>")
        xs, vs = _cp(x), _cp(buf.data)
        sc = _cp(scale) if scale is not None else vs   # unused pointer when there is no scale
        for c in steps:
            fn((blocks,), (FUSED_UPDATE_THREADS,), (xs, vs, sc, cp.int64(n), cp.float32(c)))
            LAUNCHES["drift_shift"] += 1
    return None


def _fold_scalars(lr: float, beta: float) -> tuple[float, float, float]:
    """The shard fold's fp32 constants, as the kernel receives them: 1 / lr, beta, (1 - beta) / lr."""
    import numpy as np
    return float(np.float32(1.0 / lr)), float(np.float32(beta)), float(np.float32((1.0 - beta) / lr))


@torch.no_grad()
def shard_fold_reference(after: torch.Tensor, before: torch.Tensor, buf: CompactBuffer, *, lr: float, beta: float,
                         first: bool, key: int, moments: bool = False) -> torch.Tensor:
    """A real step's fold into the drift velocity ``buf`` from a shard's value ``after`` its
    optimizer step and its copy from ``before`` it (``memory.fold_source: weights16``), in
    torch, a chunk at a time: ``d = after - before`` in fp32, ``v = d / lr`` on the first fold,
    else ``v = fma(d, (1 - beta) / lr, v * beta)``, stored as the buffer's dtype (int8: rounded
    stochastically with ``quant.sr_uniform(key, index)``). Returns fp64 sums on ``after``'s
    device: ``d . v``, ``v . v`` and ``d . d`` with ``v`` the velocity before the fold, and
    ``after . after`` with ``moments`` (0 without), each an fp64 sum of exact products.

    ``zero_access.fold_real_update``'s torch path takes the same steps with fp32 dots, a torch
    generator's int8 noise and an unfused multiply-add; this is the kernel's own definition."""
    inv_lr, beta32, gain = _fold_scalars(lr, beta)
    sums = torch.zeros(4, dtype=torch.float64, device=after.device)
    d_work, v_work = scratch(after.device, 2, after.numel()), scratch(after.device, 3, after.numel())
    for a, b in buf.chunks():
        d = d_work[:b - a].copy_(after[a:b]).sub_(before[a:b])
        v = v_work[:b - a].copy_(buf.data[a:b]) if buf.dtype != "int8" else buf.load(a, b, out=v_work)
        d64, v64 = d.double(), v.double()
        sums[0] += torch.dot(d64, v64)
        sums[1] += torch.dot(v64, v64)
        sums[2] += torch.dot(d64, d64)
        if moments:
            w64 = after[a:b].double()
            sums[3] += torch.dot(w64, w64)
        if first:
            v.copy_(d).mul_(inv_lr)
        else:   # (one rounding of d * gain + v * beta, as the kernel's fma: exact in fp64 but in rare ties)
            v.copy_(torch.add(v.mul_(beta32).double(), d64, alpha=gain))
        buf.store(v, a, clobber=True, noise_key=key)
    return sums


def shard_fold(after: torch.Tensor, before: torch.Tensor, buf: CompactBuffer, *, lr: float, beta: float,
               first: bool, key: int, moments: bool = False, backend: str = "auto") -> torch.Tensor:
    """``shard_fold_reference`` in one pass (``kernels/fused_update.cu``'s ``shard_fold<X,VD,MOM>``:
    both shards read, the velocity read and written, 6 bytes a value with bf16 shards and an int8
    velocity) or in torch. ``after`` and ``before``: flat contiguous fp32 / bf16 / fp16 shards of
    one dtype, as long as ``buf``, on one CUDA device with it. Returns the fp64 sums there."""
    scale = buf.scale if buf.dtype == "int8" else None
    choice = resolve_backend(backend, after, before, buf.data, scale)
    fits = (after.is_contiguous() and before.is_contiguous() and after.dtype == before.dtype
            and after.dtype in _X_CODES and after.numel() == before.numel() == buf.numel)
    mod = _fused_module(backend, choice, fits, after.device,
                        "shard_fold: the kernel needs two contiguous fp32/bf16/fp16 shards of one dtype as long as "
                        "the velocity")
    kw = dict(lr=lr, beta=beta, first=first, key=key, moments=moments)
    if mod is None:
        return shard_fold_reference(after, before, buf, **kw)
    sums = torch.zeros(4, dtype=torch.float64, device=after.device)
    n = after.numel()
    if n == 0:
        return sums
    inv_lr, beta32, gain = _fold_scalars(lr, beta)
    blocks = max(1, min(math.ceil(n / SHARD_FOLD_THREADS), 16 * _sm_count(after.device)))
    with _on_torch_stream(after.device) as cp:
        fn = mod.get_function(f"shard_fold<{_X_CODES[after.dtype]},{_VD_CODES[buf.dtype]},"
                              f"{'true' if moments else 'false'}>")
        vs = _cp(buf.data)
        fn((blocks,), (SHARD_FOLD_THREADS,), (_cp(after), _cp(before), vs, _cp(scale) if scale is not None else vs,
                                              _cp(sums), cp.int64(n), cp.float32(inv_lr), cp.float32(beta32),
                                              cp.float32(gain), cp.int32(1 if first else 0),
                                              cp.uint32(int(key) & 0xFFFFFFFF)))
    LAUNCHES["shard_fold"] += 1
    return sums


def fused_update_bytes(n: int, lp: bool, snapshot: bool) -> int:
    """Bytes the fused update moves for n elements: reads master, m, v; writes master (+ lp, snapshot)."""
    return n * (16 + (2 if lp else 0) + (4 if snapshot else 0))


# ---------------------------------------------------------------------------
# 2. RSSM step and rollout
# ---------------------------------------------------------------------------

RSSM_WEIGHTS = ("W_in", "b_in", "W_ih", "b_ih", "W_hh", "b_hh", "W_pr", "b_pr", "W_h1", "b_h1", "W_h2", "b_h2")
_rssm_views: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _rssm_threads(deter: int) -> int:
    return min(1024, max(128, 32 * math.ceil(3 * deter / 32)))


def _rssm_smem_bytes(s, threads: int) -> int:
    D, S, H, A, HO = s.deter, s.stoch, s.hidden, s.action, s.head_out
    return 4 * (D + S + A + H + 6 * D + 2 * S + H + HO + threads)


def _rssm_weight_views(model) -> list:
    params = [getattr(model, n) for n in RSSM_WEIGHTS]
    for n, p in zip(RSSM_WEIGHTS, params):
        if p.dtype != torch.float32 or not p.is_contiguous():
            raise ValueError(f"rssm kernels: {n} must be a contiguous float32 tensor (got {p.dtype})")
    key = tuple(p.data_ptr() for p in params)
    cached = _rssm_views.get(model)
    if cached is None or cached[0] != key:
        cached = (key, [_cp(p) for p in params])
        _rssm_views[model] = cached
    return cached[1]


def _rssm_inputs(model, tensors: dict[str, torch.Tensor], lead: tuple[int, ...]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (t, last) in tensors.items():
        if tuple(t.shape[:len(lead)]) != lead or t.shape[-1] != last:
            raise ValueError(f"rssm kernels: {name} must have shape {lead + (last,)} (got {tuple(t.shape)})")
        out[name] = t.detach().to(torch.float32).contiguous()
    return out


def _rssm_kernel_ok(model, backend: str, *tensors) -> Any:
    """The compiled rssm module when the kernel path applies, else None (torch path)."""
    params = [getattr(model, n) for n in RSSM_WEIGHTS]
    choice = resolve_backend(backend, *tensors, *params)
    if choice != "cupy":
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        if backend == "cupy":
            raise KernelUnavailable(f"{SETTING} is 'cupy' but the rssm kernels have no backward; call them "
                                    f"under torch.no_grad() (training steps use the torch path)")
        return None
    smem = _rssm_smem_bytes(model.shape, _rssm_threads(model.shape.deter))
    if smem > 48 * 1024:   # the static limit without opting in to more shared memory per block
        if backend == "cupy":
            raise KernelUnavailable(f"{SETTING} is 'cupy' but the rssm kernels hold a row's state in at most "
                                    f"48 KiB of shared memory; deter {model.shape.deter} needs {smem} bytes")
        return None
    return _module_or_fallback("rssm", backend, params[0].device)


def rssm_step(model, h: torch.Tensor, z: torch.Tensor, a: torch.Tensor, *,
              backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transition and its prior for every member: ``(h', prior mean, prior std)``, each [E, B, .].

    The torch path is ``h' = model.step(h, z, a)``; ``model.prior(h')``. The kernel
    (``rssm.cu:rssm_step``) does both in one launch, one block per (batch row, member). Under
    autograd (gradients enabled and the model's weights requiring them) ``auto`` takes the
    torch path: the kernel has no backward.
    """
    mod = _rssm_kernel_ok(model, backend, h, z, a)
    if mod is None:
        h2 = model.step(h, z, a)
        pm, ps = model.prior(h2)
        return h2, pm, ps
    s = model.shape
    E, B = h.shape[0], h.shape[1]
    if E != s.members:
        raise ValueError(f"rssm_step: h has {E} members, the model {s.members}")
    x = _rssm_inputs(model, {"h": (h, s.deter), "z": (z, s.stoch), "a": (a, s.action)}, (E, B))
    dev = h.device
    h_out = torch.empty(E, B, s.deter, device=dev)
    pm = torch.empty(E, B, s.stoch, device=dev)
    ps = torch.empty(E, B, s.stoch, device=dev)
    threads = _rssm_threads(s.deter)
    with _on_torch_stream(dev) as cp:
        fn = mod.get_function("rssm_step")
        args = (*_rssm_weight_views(model), _cp(x["h"]), _cp(x["z"]), _cp(x["a"]), _cp(h_out), _cp(pm), _cp(ps),
                cp.int32(B), cp.int32(s.deter), cp.int32(s.stoch), cp.int32(s.hidden), cp.int32(s.action),
                cp.int32(s.head_out), cp.float32(s.min_std))
        fn((B, E), (threads,), args, shared_mem=_rssm_smem_bytes(s, threads))
    LAUNCHES["rssm_step"] += 1
    return h_out, pm, ps


def rssm_rollout(model, h: torch.Tensor, z: torch.Tensor, actions: torch.Tensor, *,
                 backend: str = "auto") -> dict[str, torch.Tensor]:
    """``model.rollout(h, z, actions)`` (``actions [E, B, K, A]``): the same dict of heads, ``h`` and ``z``.

    The kernel (``rssm.cu:rssm_rollout``) runs the K steps in one launch with each (member,
    batch row)'s state kept in shared memory. Inference only, as the reference.
    """
    with torch.no_grad():
        mod = _rssm_kernel_ok(model, backend, h, z, actions)
        if mod is None:
            return model.rollout(h, z, actions)
        s = model.shape
        E, B, K = actions.shape[0], actions.shape[1], actions.shape[2]
        if E != s.members:
            raise ValueError(f"rssm_rollout: actions have {E} members, the model {s.members}")
        x = _rssm_inputs(model, {"h": (h, s.deter), "z": (z, s.stoch), "actions": (actions, s.action)}, (E, B))
        dev = h.device
        hs = torch.empty(E, B, K, s.deter, device=dev)
        zs = torch.empty(E, B, K, s.stoch, device=dev)
        heads = torch.empty(E, B, K, s.head_out, device=dev)
        if K > 0:
            threads = _rssm_threads(s.deter)
            with _on_torch_stream(dev) as cp:
                fn = mod.get_function("rssm_rollout")
                args = (*_rssm_weight_views(model), _cp(x["h"]), _cp(x["z"]), _cp(x["actions"]), _cp(hs),
                        _cp(zs), _cp(heads), cp.int32(B), cp.int32(s.deter), cp.int32(s.stoch),
                        cp.int32(s.hidden), cp.int32(s.action), cp.int32(s.head_out), cp.int32(K))
                fn((B, E), (threads,), args, shared_mem=_rssm_smem_bytes(s, threads))
            LAUNCHES["rssm_rollout"] += 1
        KH = s.horizon
        return {"loss_mean": heads[..., :KH], "loss_std": heads[..., KH:2 * KH],
                "scale_mean": heads[..., 2 * KH], "scale_std": heads[..., 2 * KH + 1], "h": hs, "z": zs}


# ---------------------------------------------------------------------------
# 3. State encoder window features
# ---------------------------------------------------------------------------

def window_features(hist: torch.Tensor, counts: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Features 0-38 of the state encoding from ``hist [8, 32]`` (or a batch ``[N, 8, 32]``) and
    ``counts [8]`` (``[N, 8]``): float64 ``[39]`` (``[N, 39]``) on hist's device.

    The torch path is ``dynamics.window.window_features`` (a CPU function: CUDA inputs are
    copied to the host and the result back). The kernel (``encoder.cu``) computes in fp64, one
    block per history.
    """
    batched = hist.dim() == 3
    if hist.shape[-2:] != (NUM_CHANNELS, WINDOW) or counts.shape[-1] != NUM_CHANNELS \
            or counts.shape[:-1] != hist.shape[:-2] or hist.dim() not in (2, 3):
        raise ValueError(f"window_features: hist [N?, {NUM_CHANNELS}, {WINDOW}] and counts [N?, {NUM_CHANNELS}] "
                         f"(got {tuple(hist.shape)} and {tuple(counts.shape)})")
    choice = resolve_backend(backend, hist, counts)
    mod = _module_or_fallback("encoder", backend, hist.device) if choice == "cupy" else None
    if mod is None:
        h, c = hist.detach().cpu(), counts.detach().cpu()
        rows = ([window_features_reference(h[i], c[i]) for i in range(h.shape[0])] if batched
                else [window_features_reference(h, c)])
        out = torch.stack(rows) if batched else rows[0]
        return out.to(hist.device)
    h = hist.detach().to(torch.float64).contiguous().view(-1, NUM_CHANNELS, WINDOW)
    c = counts.detach().to(torch.int32).contiguous().view(-1, NUM_CHANNELS)
    out = torch.empty(h.shape[0], NUM_WINDOW_FEATURES, dtype=torch.float64, device=hist.device)
    if h.shape[0]:
        with _on_torch_stream(hist.device):
            fn = mod.get_function("window_features")
            fn((h.shape[0],), (256,), (_cp(h), _cp(c), _cp(out)))
        LAUNCHES["window_features"] += 1
    return out if batched else out[0]


# ---------------------------------------------------------------------------
# What is available
# ---------------------------------------------------------------------------

KERNEL_FILES = ("fused_update", "rssm", "encoder")


def availability() -> dict[str, Any]:
    """What the kernels need and whether it is here (for ``ds-hybrid report``)."""
    info: dict[str, Any] = {"cuda_device": torch.cuda.is_available(), "cupy_packages": cupy_packages(),
                            "kernel_dir": str(KERNEL_DIR),
                            "kernel_files": {k: (KERNEL_DIR / f"{k}.cu").is_file() for k in KERNEL_FILES}}
    try:
        cp = import_cupy()
        info["cupy_import"] = True
        info["cupy_version"] = getattr(cp, "__version__", "?")
    except KernelUnavailable as exc:
        info["cupy_import"] = False
        info["cupy_error"] = str(exc)
    info["auto_on_cuda_tensors"] = "cupy" if info["cuda_device"] and info["cupy_import"] else "torch"
    if len(info["cupy_packages"]) > 1:
        info["warning"] = (f"several CuPy packages are installed ({', '.join(info['cupy_packages'])}); "
                           f"keep only the one matching the CUDA driver")
    return info


def smoke_test_kernels() -> dict[str, str]:
    """Build every kernel module and run each dispatcher once against its reference (needs a GPU)."""
    results: dict[str, str] = {}
    if not torch.cuda.is_available():
        return {k: "skipped: no CUDA device" for k in KERNEL_FILES}
    dev = torch.device("cuda", torch.cuda.current_device())
    for name in KERNEL_FILES:
        try:
            load_module(name, FUSED_UPDATE_MODULE if name == "fused_update" else (), device=dev.index)
            results[name] = "compiled"
        except Exception as exc:  # report, don't raise
            results[name] = f"FAILED: {str(exc).splitlines()[0]}"
            continue
        try:
            _check_one(name, dev)
            results[name] += ", matches its reference"
        except Exception as exc:
            results[name] += f", MISMATCH or launch error: {str(exc).splitlines()[0]}"
    return results


def _check_one(name: str, dev: torch.device) -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    if name == "fused_update":
        n = 10_001
        m = torch.randn(n, generator=gen).to(dev)
        v = torch.rand(n, generator=gen).to(dev)
        w = torch.randn(n, generator=gen).to(dev)
        kw = dict(lr=1e-3, scale=0.5, beta1=0.9, beta2=0.999, eps=1e-8, step=10, weight_decay=0.01,
                  decoupled=True)
        a, b = w.clone(), w.clone()
        fused_update_reference(a, m, v, **kw)
        fused_update(b, m, v, backend="cupy", **kw)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        vel = CompactBuffer(n, "int8", dev)
        vel.store(torch.randn(n, generator=gen).to(dev), generator=torch.Generator(device=dev).manual_seed(0))
        x = torch.randn(n, generator=gen).to(dev, torch.bfloat16)
        a, b = x.clone(), x.clone()
        drift_shift_reference(a, vel, [1e-3, 2e-3])
        drift_shift(b, vel, [1e-3, 2e-3], backend="cupy")
        assert torch.equal(a, b), "drift_shift differs from its reference"
    elif name == "rssm":
        from .dynamics.rssm import RSSMEnsemble
        model = RSSMEnsemble().to(dev)
        E = model.shape.members
        h0, z0 = torch.randn(E, 2, model.shape.deter, device=dev), torch.randn(E, 2, model.shape.stoch, device=dev)
        acts = torch.rand(E, 2, 4, model.shape.action, device=dev)
        with torch.no_grad():
            ref, got = model.rollout(h0, z0, acts), rssm_rollout(model, h0, z0, acts, backend="cupy")
        torch.testing.assert_close(got["loss_mean"], ref["loss_mean"], rtol=1e-4, atol=1e-4)
    else:
        hist = torch.randn(8, 32, dtype=torch.float64, generator=gen)
        counts = torch.tensor([32, 20, 8, 5, 3, 2, 1, 0], dtype=torch.int32)
        ref = window_features(hist, counts, backend="torch")
        got = window_features(hist.to(dev), counts.to(dev), backend="cupy").cpu()
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
