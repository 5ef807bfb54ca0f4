"""Per-step memory of a training run: host, pinned host, torch's CUDA allocator, the whole GPU.

``MemoryProfiler.record(step, phase)`` is called once per optimizer step, right after
``engine.train_step``. Each call reads:

* host: the process's resident set (``VmRSS``) and its high-water mark since the previous
  record (``VmHWM`` from ``/proc/self/status``, reset by writing ``5`` to
  ``/proc/self/clear_refs`` after each read), so ``rss_peak_mb`` is the step's own peak,
  activations of the backward pass included. Where the mark cannot be reset (not Linux, or
  ``/proc`` read-only) ``rss_peak_mb`` is the RSS at the end of the step, and the report says so;
* pinned host memory held by torch's CUDA host allocator (``torch.cuda.host_memory_stats()``,
  where DeepSpeed's pinned offload and swap buffers come from); 0 without CUDA;
* with CUDA: ``torch.cuda.memory_allocated`` / ``memory_reserved`` / ``max_memory_allocated``
  (its peak is reset after each read, like the host's), the allocator's calls to the driver in
  the step (``num_device_alloc`` / ``num_device_free`` / ``num_alloc_retries``: a step that
  frees and retakes GPU memory, as one after a Predict run under a memory cap may, pays for
  it in device synchronisations) and, through NVML (``nvidia-ml-py``,
  imported on the first record of a CUDA run only), the used memory of the whole device,
  other processes and the CUDA context included.

No call synchronises the GPU. What a record costs is timed and reported
(``overhead_s``, ``overhead_fraction()``, and split into host / CUDA allocator / NVML reads in
``overhead_parts_s``): about 10 microseconds on an idle CPU core. Starting NVML is a one-off
(tens of milliseconds in a VM): it happens in ``begin()``, with set-up, and is reported as
``nvml_init_s``, not charged to the steps.

Resetting the high-water marks changes what ``resource.getrusage().ru_maxrss`` and
``torch.cuda.max_memory_allocated()`` report afterwards (the peak since the last reset):
use ``process_peak_rss_mb`` and ``process_peak_gpu_allocated_mb`` for the whole run.

**Spikes.** A step is a spike in a metric when its value is more than ``spike_rel`` (10%)
*and* more than ``spike_abs_mb`` (64 MB) above the median of that metric over the previous
``spike_window`` (20) steps, with at least ``spike_min_history`` (5) steps of history; the
metrics checked are the per-step host RSS peak and the per-step GPU allocator peak.
"""
from __future__ import annotations

import csv
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Sequence

MB = 2 ** 20
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_PHASE_ORDER = ("warmup", "full", "predict", "correct")
SPIKE_METRICS = ("rss_peak_mb", "gpu_peak_allocated_mb")
ALLOC_COUNTS = ("gpu_device_allocs", "gpu_device_frees", "gpu_alloc_retries")   # MemorySample's, summed per phase


@dataclass
class MemorySample:
    """One optimizer step's memory figures (MB = 2**20 bytes; None where not measured)."""

    step: int
    phase: str
    time_s: float                         # seconds since the profiler was created
    step_time_s: float | None             # the step's own time, as the engine reported it
    rss_mb: float                         # host resident set when recorded (end of the step)
    rss_peak_mb: float                    # highest host RSS since the previous record
    pinned_host_mb: float                 # torch's CUDA host (pinned) allocator; 0 without CUDA
    gpu_allocated_mb: float | None = None
    gpu_reserved_mb: float | None = None
    gpu_peak_allocated_mb: float | None = None   # allocator peak since the previous record
    gpu_device_used_mb: float | None = None      # NVML: the whole device, every process
    # torch's CUDA allocator in this step: blocks it took from the driver (cudaMalloc) and gave back
    # (cudaFree), and requests it retried after freeing its whole cache (a cap reached with the
    # cache fragmented: each retry synchronises the device). A steady step takes none of them.
    gpu_device_allocs: int | None = None
    gpu_device_frees: int | None = None
    gpu_alloc_retries: int | None = None


def detect_spikes(values: Sequence[float | None], window: int = 20, rel: float = 0.10,
                  abs_mb: float = 64.0, min_history: int = 5) -> list[tuple[int, float, float]]:
    """Indices of spikes in ``values`` as ``(index, value, median_before)``.

    ``values[i]`` is a spike when ``values[i] - m > max(rel * m, abs_mb)``, ``m`` being the
    median of the (non-None) values among the previous ``window`` entries, of which there
    must be at least ``min_history``. A spike stays in the window of later steps, so a
    lasting jump is reported on the steps where the median has not caught up with it.
    """
    if window < 1 or min_history < 1 or rel < 0 or abs_mb < 0:
        raise ValueError("detect_spikes: window and min_history must be >= 1, rel and abs_mb >= 0")
    out = []
    for i, v in enumerate(values):
        if v is None or not math.isfinite(v):
            continue
        history = [x for x in values[max(0, i - window):i] if x is not None and math.isfinite(x)]
        if len(history) < min_history:
            continue
        m = statistics.median(history)
        if v - m > max(rel * abs(m), abs_mb):
            out.append((i, float(v), float(m)))
    return out


def _read_host() -> tuple[float, float]:
    """(current RSS, high-water RSS) of this process in bytes."""
    try:
        with open(_STATUS, "rb") as f:
            text = f.read()
        i, j = text.find(b"VmHWM:"), text.find(b"VmRSS:")
        if i >= 0 and j >= 0:  # "VmHWM:\t  123456 kB"
            hwm = int(text[i + 6:text.index(b"kB", i)])
            rss = int(text[j + 6:text.index(b"kB", j)])
            return float(rss * 1024), float(hwm * 1024)
    except OSError:
        pass
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return float(peak), float(peak)


def _alloc_counts(stats: dict) -> tuple[int, int, int] | None:
    """(cudaMalloc calls, cudaFree calls, retries) so far, from torch's nested allocator
    statistics (a torch without the call counters: the segments taken and given back, one
    cudaMalloc or cudaFree each); None where it has neither."""
    try:
        retries = int(stats["num_alloc_retries"])
        if "num_device_alloc" in stats:
            return int(stats["num_device_alloc"]), int(stats["num_device_free"]), retries
        seg = stats["segment"]["all"]
        return int(seg["allocated"]), int(seg["freed"]), retries
    except (KeyError, TypeError, ValueError):
        return None


def _reset_host_peak() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")  # Linux >= 4.0: reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


class _Nvml:
    """Used memory of this process's GPU through NVML; imported on first use, disabled on any error."""

    def __init__(self, device_index: int) -> None:
        self.handle = None
        self.error: str | None = None
        try:
            import pynvml
            import torch
            pynvml.nvmlInit()
            self._pynvml = pynvml
            uuid = str(getattr(torch.cuda.get_device_properties(device_index), "uuid", "") or "")
            if uuid:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            else:  # map the torch index through CUDA_VISIBLE_DEVICES to NVML's
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
                ids = [int(x) for x in visible.split(",") if x.strip().isdigit()]
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(ids[device_index] if ids else device_index)
        except Exception as err:  # no driver, no pynvml, a MIG slice NVML cannot name: host figures still work
            self.handle, self.error = None, f"{type(err).__name__}: {err}"

    def used_bytes(self) -> float | None:
        if self.handle is None:
            return None
        try:
            return float(self._pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception as err:
            self.handle, self.error = None, f"{type(err).__name__}: {err}"
            return None


class MemoryProfiler:
    """Records memory once per optimizer step; summarises per phase, finds spikes, writes CSV/PNG/text.

    Create it before the model is built (its RSS then is the **baseline**: interpreter,
    libraries and data, no model), call ``begin()`` after the engine is built (the peak
    since creation is the **setup peak**: model construction and ``deepspeed.initialize``),
    then ``record(step, phase, step_time_s)`` after every ``train_step``. Call
    ``reset_peak()`` after work that should not count towards the next step (validation).
    """

    def __init__(self, device: Any = None, spike_window: int = 20, spike_rel: float = 0.10,
                 spike_abs_mb: float = 64.0, spike_min_history: int = 5, use_nvml: bool = True) -> None:
        self.spike_window, self.spike_rel = spike_window, spike_rel
        self.spike_abs_mb, self.spike_min_history = spike_abs_mb, spike_min_history
        self.use_nvml = use_nvml
        self.samples: list[MemorySample] = []
        self.overhead_s = 0.0
        self._t0 = time.perf_counter()
        self._device = device
        self._cuda: bool | None = None   # decided on first use, so CUDA is never initialised here
        self._nvml: _Nvml | None = None
        rss, hwm = _read_host()
        self.baseline_rss_mb = rss / MB
        self._process_peak_rss = hwm          # before any reset: the process's peak so far
        self._process_peak_gpu = 0.0
        self._alloc_counts: tuple[int, int, int] | None = None   # the CUDA allocator's at the last read
        self.peak_resettable = _reset_host_peak()
        self.setup_peak_rss_mb: float | None = None
        self.overhead_parts_s = {"host": 0.0, "cuda": 0.0, "nvml": 0.0}
        self.pinned_read = False            # torch's pinned allocator gave a figure at least once
        self.pinned_error: str | None = None   # why it could not (its first error)
        self.nvml_init_s: float | None = None

    # ------------------------------------------------------------ recording
    def _cuda_on(self) -> bool:
        if self._cuda is None:
            try:
                import torch
                dev = self._device
                wants_cuda = dev is None or getattr(dev, "type", str(dev).split(":")[0]) == "cuda"
                self._cuda = bool(wants_cuda and torch.cuda.is_available() and torch.cuda.is_initialized())
            except Exception:
                self._cuda = False
        return self._cuda

    def _cuda_index(self) -> int:
        import torch
        dev = self._device
        if dev is not None and getattr(dev, "index", None) is not None:
            return int(dev.index)
        return torch.cuda.current_device()

    def reset_peak(self) -> None:
        """Start a new peak window (host high-water mark and the CUDA allocator's peak)."""
        t = time.perf_counter()
        rss, hwm = _read_host()
        self._process_peak_rss = max(self._process_peak_rss, hwm)
        if self.peak_resettable:
            self.peak_resettable = _reset_host_peak()
        if self._cuda_on():
            import torch
            idx = self._cuda_index()
            self._process_peak_gpu = max(self._process_peak_gpu, float(torch.cuda.max_memory_allocated(idx)))
            torch.cuda.reset_peak_memory_stats(idx)
            self._alloc_counts = _alloc_counts(torch.cuda.memory_stats_as_nested_dict(idx))
        self.overhead_s += time.perf_counter() - t

    def begin(self) -> None:
        """End of set-up (model built, engine initialised): note the setup peak, start NVML on a
        CUDA run, open step 1's window."""
        _, hwm = _read_host()
        self.setup_peak_rss_mb = hwm / MB
        self._start_nvml()
        self.reset_peak()

    def _start_nvml(self) -> None:
        if self._nvml is None and self.use_nvml and self._cuda_on():
            t = time.perf_counter()
            self._nvml = _Nvml(self._cuda_index())
            self.nvml_init_s = time.perf_counter() - t

    def record(self, step: int, phase: str, step_time_s: float | None = None) -> MemorySample:
        """Read every figure for the step just finished and open the next step's window."""
        self._start_nvml()   # a no-op after begin(); its one-off start is never charged to a step
        t = time.perf_counter()
        rss, hwm = _read_host()
        self._process_peak_rss = max(self._process_peak_rss, hwm)
        peak = hwm if self.peak_resettable else rss
        if self.peak_resettable:
            self.peak_resettable = _reset_host_peak()
        sample = MemorySample(step=int(step), phase=str(phase), time_s=t - self._t0,
                              step_time_s=None if step_time_s is None else float(step_time_s),
                              rss_mb=rss / MB, rss_peak_mb=max(peak, rss) / MB, pinned_host_mb=0.0)
        t_host = time.perf_counter()
        self.overhead_parts_s["host"] += t_host - t
        t_nvml = 0.0
        if self._cuda_on():
            import torch
            idx = self._cuda_index()
            # One read of the allocator's statistics: memory_allocated / memory_reserved /
            # max_memory_allocated each rebuild and flatten the whole dict (~0.15 ms apiece).
            st = torch.cuda.memory_stats_as_nested_dict(idx)
            peak_gpu = float(st["allocated_bytes"]["all"]["peak"])
            self._process_peak_gpu = max(self._process_peak_gpu, peak_gpu)
            sample.gpu_allocated_mb = st["allocated_bytes"]["all"]["current"] / MB
            sample.gpu_reserved_mb = st["reserved_bytes"]["all"]["current"] / MB
            sample.gpu_peak_allocated_mb = peak_gpu / MB
            counts = _alloc_counts(st)
            if counts is not None and self._alloc_counts is not None:
                sample.gpu_device_allocs, sample.gpu_device_frees, sample.gpu_alloc_retries = (
                    now - before for now, before in zip(counts, self._alloc_counts))
            self._alloc_counts = counts
            torch.cuda.reset_peak_memory_stats(idx)
            try:
                pinned = torch.cuda.host_memory_stats()
                if "allocated_bytes.current" in pinned:
                    sample.pinned_host_mb = float(pinned["allocated_bytes.current"]) / MB
                    self.pinned_read = True
            except Exception as e:   # (a torch that cannot say: the summary says so, no 0 posing as a reading)
                self.pinned_error = self.pinned_error or f"torch.cuda.host_memory_stats: {e!r}"
            if self.use_nvml:
                t0_nvml = time.perf_counter()
                used = self._nvml.used_bytes() if self._nvml is not None else None
                sample.gpu_device_used_mb = None if used is None else used / MB
                t_nvml = time.perf_counter() - t0_nvml
        self.samples.append(sample)
        end = time.perf_counter()
        self.overhead_parts_s["nvml"] += t_nvml
        self.overhead_parts_s["cuda"] += max(0.0, end - t_host - t_nvml) if self._cuda_on() else 0.0
        self.overhead_s += end - t
        return sample

    # ------------------------------------------------------------ results
    @property
    def process_peak_rss_mb(self) -> float:
        """Peak host RSS of the whole process (before creation, set-up and every step)."""
        _, hwm = _read_host()
        return max(self._process_peak_rss, hwm) / MB

    @property
    def process_peak_gpu_allocated_mb(self) -> float | None:
        """Peak of torch's CUDA allocator over the whole run (None without CUDA)."""
        if not self._cuda_on():
            return None
        import torch
        return max(self._process_peak_gpu, float(torch.cuda.max_memory_allocated(self._cuda_index()))) / MB

    def overhead_fraction(self) -> float | None:
        """Time spent in the profiler as a fraction of the recorded steps' time."""
        total = sum(s.step_time_s for s in self.samples if s.step_time_s)
        return self.overhead_s / total if total else None

    def phase_summary(self) -> dict[str, dict[str, Any]]:
        """Per phase (in Warmup, Full, Predict, Correct order): steps, peak and mean of each figure."""
        by_phase: dict[str, list[MemorySample]] = {}
        for s in self.samples:
            by_phase.setdefault(s.phase, []).append(s)
        order = [p for p in _PHASE_ORDER if p in by_phase] + sorted(p for p in by_phase if p not in _PHASE_ORDER)
        out: dict[str, dict[str, Any]] = {}
        for phase in order:
            ss = by_phase[phase]
            row: dict[str, Any] = {"steps": len(ss)}
            peaks = [s.rss_peak_mb for s in ss]
            row["rss_peak_mb"] = max(peaks)
            row["rss_peak_mean_mb"] = statistics.fmean(peaks)
            row["rss_peak_above_baseline_mb"] = max(peaks) - self.baseline_rss_mb
            row["rss_mean_mb"] = statistics.fmean(s.rss_mb for s in ss)
            row["pinned_host_peak_mb"] = max(s.pinned_host_mb for s in ss)
            for key in ("gpu_allocated_mb", "gpu_reserved_mb", "gpu_peak_allocated_mb", "gpu_device_used_mb"):
                vals = [getattr(s, key) for s in ss if getattr(s, key) is not None]
                if vals:
                    row[key.replace("_mb", "_max_mb")] = max(vals)
                    row[key.replace("_mb", "_mean_mb")] = statistics.fmean(vals)
            for key in ALLOC_COUNTS:
                vals = [getattr(s, key) for s in ss if getattr(s, key) is not None]
                if vals:   # totals over the phase's steps
                    row[key] = sum(vals)
            times = [s.step_time_s for s in ss if s.step_time_s is not None]
            row["step_time_mean_s"] = statistics.fmean(times) if times else None
            out[phase] = row
        return out

    def spikes(self) -> list[dict[str, Any]]:
        """Every spike (see the module docstring) in the host and GPU per-step peaks."""
        out = []
        for metric in SPIKE_METRICS:
            values = [getattr(s, metric) for s in self.samples]
            if all(v is None for v in values):
                continue
            for i, v, m in detect_spikes(values, self.spike_window, self.spike_rel, self.spike_abs_mb,
                                         self.spike_min_history):
                s = self.samples[i]
                out.append({"step": s.step, "phase": s.phase, "metric": metric, "value_mb": v,
                            "median_mb": m, "jump_mb": v - m})
        return sorted(out, key=lambda d: (d["step"], d["metric"]))

    def summary(self) -> dict[str, Any]:
        """What goes into a run's summary.json."""
        n = len(self.samples)
        return {
            "baseline_rss_mb": self.baseline_rss_mb,
            "setup_peak_rss_mb": self.setup_peak_rss_mb,
            "process_peak_rss_mb": self.process_peak_rss_mb,
            "process_peak_gpu_allocated_mb": self.process_peak_gpu_allocated_mb,
            "per_step_peak": "reset every step" if self.peak_resettable else "end-of-step RSS (peak not resettable)",
            "phases": self.phase_summary(),
            "spikes": self.spikes(),
            "spike_rule": {"window": self.spike_window, "rel": self.spike_rel, "abs_mb": self.spike_abs_mb,
                           "min_history": self.spike_min_history},
            "steps_recorded": n,
            "overhead_s": self.overhead_s,
            "overhead_us_per_step": self.overhead_s / n * 1e6 if n else None,
            "overhead_fraction": self.overhead_fraction(),
            "overhead_parts_s": dict(self.overhead_parts_s),
            "nvml_init_s": self.nvml_init_s,
            "nvml_error": None if self._nvml is None else self._nvml.error,
            # the pinned figures were read from torch's pinned allocator at least once (False: they are 0
            # because torch gave none; pinned_error: why)
            "pinned_read": self.pinned_read,
            "pinned_error": self.pinned_error,
        }

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """One row per recorded step, the columns of ``MemorySample`` (empty where not measured)."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        names = [f.name for f in fields(MemorySample)]
        with open(out, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(names)
            for s in self.samples:
                d = asdict(s)
                w.writerow(["" if d[k] is None else (f"{d[k]:.6g}" if isinstance(d[k], float) else d[k])
                            for k in names])
        return out

    def report(self) -> str:
        """A text report: baseline and peaks, a per-phase table, spikes, the profiler's own cost."""
        s = self.summary()
        lines = [f"memory profile: {s['steps_recorded']} steps; host RSS {self.baseline_rss_mb:.1f} MB before the "
                 f"model was built, set-up peak "
                 f"{'-' if self.setup_peak_rss_mb is None else f'{self.setup_peak_rss_mb:.1f}'} MB, "
                 f"process peak {s['process_peak_rss_mb']:.1f} MB"]
        if s["process_peak_gpu_allocated_mb"] is not None:
            lines[0] += f", GPU allocator peak {s['process_peak_gpu_allocated_mb']:.1f} MB"
        lines.append("per-step RSS peak: " + ("the step's own high-water mark (VmHWM reset after every step)"
                                              if self.peak_resettable else
                                              "RSS at the end of the step (the high-water mark cannot be reset "
                                              "here, so peaks inside a step are not seen)"))
        gpu = any(s_.gpu_allocated_mb is not None for s_ in self.samples)
        head = f"{'phase':<9}{'steps':>6}{'RSS peak':>10}{'mean peak':>11}{'over base':>11}{'pinned':>8}"
        if gpu:
            head += f"{'GPU alloc':>11}{'GPU peak':>10}{'reserved':>10}{'device':>9}"
        lines += ["", head + "   (MB)"]
        for phase, r in s["phases"].items():
            line = (f"{phase:<9}{r['steps']:>6}{r['rss_peak_mb']:>10.1f}{r['rss_peak_mean_mb']:>11.1f}"
                    f"{r['rss_peak_above_baseline_mb']:>11.1f}{r['pinned_host_peak_mb']:>8.1f}")
            if gpu:
                def cell(key: str, width: int) -> str:
                    v = r.get(key)
                    return f"{'-':>{width}}" if v is None else f"{v:>{width}.1f}"
                line += (cell("gpu_allocated_max_mb", 11) + cell("gpu_peak_allocated_max_mb", 10)
                         + cell("gpu_reserved_max_mb", 10) + cell("gpu_device_used_max_mb", 9))
            lines.append(line)
        rule = (f">{self.spike_rel:.0%} and >{self.spike_abs_mb:g} MB over the median of the previous "
                f"{self.spike_window} steps")
        if s["spikes"]:
            lines += ["", f"spikes ({rule}):"]
            for sp in s["spikes"][:20]:
                lines.append(f"  step {sp['step']} ({sp['phase']}): {sp['metric']} {sp['value_mb']:.1f} MB, "
                             f"median {sp['median_mb']:.1f} MB (+{sp['jump_mb']:.1f})")
            if len(s["spikes"]) > 20:
                lines.append(f"  ... {len(s['spikes']) - 20} more in summary.json")
        else:
            lines += ["", f"spikes ({rule}): none"]
        frac = s["overhead_fraction"]
        per = s["overhead_us_per_step"]
        lines.append(f"profiler cost: {self.overhead_s * 1e3:.2f} ms in total"
                     + ("" if per is None else f", {per:.1f} us per step")
                     + ("" if frac is None else f", {frac:.4%} of step time")
                     + " (" + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.overhead_parts_s.items() if v) + ")"
                     + ("" if self.nvml_init_s is None else f"; starting NVML took {self.nvml_init_s * 1e3:.1f} ms, "
                                                           f"in set-up"))
        return "\n".join(lines)

    def plot(self, path: str | os.PathLike[str], title: str = "Memory by step") -> Path:
        """PNG timeline: host RSS (per-step peak and end of step) and, with CUDA, the GPU
        figures, against step, phases shaded as in the loss plot, spikes marked."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        from ..plotting import PHASE_COLOURS, _phase_runs

        if not self.samples:
            raise ValueError("MemoryProfiler.plot: no steps recorded")
        ss = sorted(self.samples, key=lambda s: s.step)
        steps = [s.step for s in ss]
        gpu = any(s.gpu_allocated_mb is not None for s in ss)
        fig = Figure(figsize=(10, 7 if gpu else 4.5), dpi=100)
        FigureCanvasAgg(fig)
        axes = [fig.add_subplot(2 if gpu else 1, 1, i + 1) for i in range(2 if gpu else 1)]
        runs = _phase_runs(steps, [s.phase for s in ss])
        spikes = self.spikes()
        for ax in axes:
            for phase, first, last in runs:
                ax.axvspan(first - 0.5, last + 0.5, color=PHASE_COLOURS.get(phase, "#cccccc"), alpha=0.15, lw=0)
        phase_handles = [Patch(color=PHASE_COLOURS.get(p, "#cccccc"), alpha=0.3, label=p)
                         for p in dict.fromkeys(s.phase for s in ss)]

        host = axes[0]
        host.plot(steps, [s.rss_peak_mb for s in ss], color="black", lw=1.0, label="RSS peak in step")
        host.plot(steps, [s.rss_mb for s in ss], color="tab:purple", lw=0.8, alpha=0.8, label="RSS at step end")
        host.axhline(self.baseline_rss_mb, color="grey", ls="--", lw=0.8, label="baseline (before model)")
        if any(s.pinned_host_mb for s in ss):
            host.plot(steps, [s.pinned_host_mb for s in ss], color="tab:brown", lw=0.8, label="pinned host")
        host_spikes = [d for d in spikes if d["metric"] == "rss_peak_mb"]
        if host_spikes:
            host.scatter([d["step"] for d in host_spikes], [d["value_mb"] for d in host_spikes], marker="x",
                         color="red", s=40, zorder=3, label="spike")
        host.set_ylabel("host MB")
        host.set_title(title)
        if gpu:
            g = axes[1]
            for key, colour, label in (("gpu_peak_allocated_mb", "black", "allocator peak in step"),
                                       ("gpu_allocated_mb", "tab:blue", "allocated"),
                                       ("gpu_reserved_mb", "tab:cyan", "reserved"),
                                       ("gpu_device_used_mb", "tab:red", "device used (NVML)")):
                pts = [(s.step, getattr(s, key)) for s in ss if getattr(s, key) is not None]
                if pts:
                    g.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, lw=1.0, label=label)
            gpu_spikes = [d for d in spikes if d["metric"] == "gpu_peak_allocated_mb"]
            if gpu_spikes:
                g.scatter([d["step"] for d in gpu_spikes], [d["value_mb"] for d in gpu_spikes], marker="x",
                          color="red", s=40, zorder=3, label="spike")
            g.set_ylabel("GPU MB")
        for ax in axes:
            ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
            ax.grid(True, alpha=0.3)
            handles, _ = ax.get_legend_handles_labels()
            ax.legend(handles=phase_handles + handles, loc="lower right", fontsize="small", ncol=2)
        axes[-1].set_xlabel("step")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
        return out

    def write(self, out_dir: str | os.PathLike[str], plot: bool = True, title: str = "Memory by step") -> list[Path]:
        """``memory.csv``, ``memory_report.txt`` and (``plot``) ``memory.png`` in ``out_dir``."""
        out = Path(out_dir)
        paths = [self.to_csv(out / "memory.csv")]
        report = out / "memory_report.txt"
        report.write_text(self.report() + "\n")
        paths.append(report)
        if plot and self.samples:
            paths.append(self.plot(out / "memory.png", title=title))
        return paths
