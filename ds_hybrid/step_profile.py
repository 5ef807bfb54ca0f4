"""Which operators a training run's steps spend their time in, per phase (``ds-hybrid train --op-profile A:B``).

DeepSpeed's timers (``wall_clock_breakdown``) and the hybrid's bookkeeping timers say how long a
step's forward, backward and optimizer step take; they cannot say what a hybrid real step runs
that plain DeepSpeed's does not. On an H200 with llama-1b under ZeRO-Offload (2026-11-27,
``docs/memory.md``) the hybrid's forward and backward took 86 ms more than plain's with no host
thread of the hybrid's beside them. This records ``torch.profiler`` over steps ``A`` to ``B``, one
session per step so that each step is booked to its phase, and sums every operator's calls, self
CPU time and self device time per phase (per step: divided by the phase's profiled steps).
``python -m ds_hybrid.step_profile RUN.json --against full`` tabulates, from a memory-bench JSON
whose runs carry these profiles, each run's per-step differences from the plain run's.

The profiled steps are slower than the others (the profiler's own cost): their step times are not
for the memory tables, which is why memory-bench runs that profile say so (``op_profile_steps``).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def parse_range(text: str, steps: int, flag: str = "--op-profile") -> tuple[int, int]:
    """``"A:B"`` -> (A, B), 1 <= A <= B <= ``steps``; a clear error naming ``flag`` otherwise."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"{flag}: expected FIRST:LAST step numbers, e.g. 9:16 (got {text!r})") from None
    if not 1 <= a <= b <= steps:
        raise SystemExit(f"{flag}: steps {a} to {b} must lie within 1..{steps} (--steps), first <= last")
    return a, b


class StepProfiler:
    """``torch.profiler`` around each step from ``first`` to ``last``, summed per phase."""

    def __init__(self, first: int, last: int, device: torch.device):
        self.first, self.last, self.device = int(first), int(last), device
        self.phases: dict[str, dict] = {}   # phase -> {"steps", "step_ms", "ops": {name: [calls, cpu_us, dev_us]}}
        self._prof = None
        self._t0 = 0.0

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._sync()   # (the step's own work only)
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def stop(self, phase: str) -> None:
        """End the step's session and book its operators to ``phase``."""
        self._sync()
        ms = (time.perf_counter() - self._t0) * 1e3
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        book = self.phases.setdefault(phase, {"steps": 0, "step_ms": 0.0, "ops": {}})
        book["steps"] += 1
        book["step_ms"] += ms
        for e in prof.key_averages():
            # (torch 2.x names the device column self_device_time_total; older ones self_cuda_time_total)
            dev = getattr(e, "self_device_time_total", None)
            if dev is None:
                dev = getattr(e, "self_cuda_time_total", 0.0)
            row = book["ops"].setdefault(e.key, [0, 0.0, 0.0])
            row[0] += int(e.count)
            row[1] += float(e.self_cpu_time_total)
            row[2] += float(dev or 0.0)

    def summary(self) -> dict:
        """Per phase: profiled steps, mean step ms (with the profiler), and per operator its calls,
        self CPU ms and self device ms per step."""
        out = {}
        for phase, book in self.phases.items():
            n = book["steps"]
            ops = {name: {"calls": c / n, "self_cpu_ms": cpu / 1e3 / n, "self_device_ms": dev / 1e3 / n}
                   for name, (c, cpu, dev) in book["ops"].items()}
            out[phase] = {"steps": n, "step_ms": book["step_ms"] / n, "ops": ops}
        return {"steps": [self.first, self.last], "device": self.device.type, "per_phase": out}


def differences(base: dict, other: dict, top: int = 20) -> list[dict]:
    """Operators by how much more self time (device + CPU, per step) ``other`` spends than ``base``
    (two ``summary()["per_phase"][phase]`` entries), the largest first; new operators included."""
    names = set(base["ops"]) | set(other["ops"])
    zero = {"calls": 0.0, "self_cpu_ms": 0.0, "self_device_ms": 0.0}
    rows = []
    for name in names:
        a, b = base["ops"].get(name, zero), other["ops"].get(name, zero)
        rows.append({"op": name, "calls": b["calls"] - a["calls"],
                     "self_cpu_ms": b["self_cpu_ms"] - a["self_cpu_ms"],
                     "self_device_ms": b["self_device_ms"] - a["self_device_ms"]})
    rows.sort(key=lambda r: -(abs(r["self_cpu_ms"]) + abs(r["self_device_ms"])))
    return rows[:top]


def table(result: dict, against: str = "full", phase: str = "full", top: int = 20) -> str:
    """Markdown: for every run of a memory-bench JSON with profiles, the operators whose per-step
    self time in ``phase`` differs most from run ``against``'s in ``phase``."""
    runs = {r["run"]: r for r in result.get("runs", []) if r.get("op_profile")}
    if against not in runs:
        raise SystemExit(f"--against: no run {against!r} with an op profile (runs with one: {sorted(runs) or 'none'})")
    base = runs[against]["op_profile"]["per_phase"].get(phase)
    if base is None:
        raise SystemExit(f"--phase: run {against!r} profiled no {phase!r} step")
    lines = []
    for name, run in runs.items():
        if name == against or phase not in run["op_profile"]["per_phase"]:
            continue
        mine = run["op_profile"]["per_phase"][phase]
        lines += [f"### {name} against {against}, {phase} steps ({mine['steps']} and {base['steps']} profiled; "
                  f"{mine['step_ms']:.1f} against {base['step_ms']:.1f} ms a step with the profiler)", "",
                  "| operator | calls | self CPU ms | self device ms |", "|---|---|---|---|"]
        lines += [f"| `{r['op'][:80]}` | {r['calls']:+.1f} | {r['self_cpu_ms']:+.2f} | {r['self_device_ms']:+.2f} |"
                  for r in differences(base, mine, top)]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m ds_hybrid.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a memory-bench JSON whose runs were profiled (--op-profile)")
    ap.add_argument("--against", default="full", help="the run to compare the others with (default: full, plain)")
    ap.add_argument("--phase", default="full", help="the phase whose steps are compared (default: full)")
    ap.add_argument("--top", type=int, default=20, help="operators per run (default 20)")
    args = ap.parse_args(argv)
    path = Path(args.json)
    if not path.is_file():
        raise SystemExit(f"{args.json}: no such file")
    text = table(json.loads(path.read_text()), args.against, args.phase, args.top)
    print(text)
    return text


if __name__ == "__main__":
    main()
