"""The memory profiler's cost per record on this machine, and the two ways to read torch's
CUDA allocator statistics side by side (the four getters the profiler used until 2026-11-23,
each of which rebuilds the flattened statistics dict, against one nested read).

    python benchmarks/profiler_cost.py --records 200 --json OUT.json

Prints a table; on a machine without CUDA only the host part is measured.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ds_hybrid.memory import MemoryProfiler


def _per_call_ms(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        keep = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # an allocator with something in it
    prof = MemoryProfiler(device=torch.device("cuda", 0) if cuda else None)
    prof.begin()
    for i in range(args.records):
        prof.record(i + 1, "full")
    n = max(len(prof.samples), 1)
    result = {"command": "python benchmarks/profiler_cost.py " + " ".join(argv or []), "records": n,
              "cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
              "host": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "record_ms": prof.overhead_s / n * 1e3,
              "record_parts_ms": {k: v / n * 1e3 for k, v in prof.overhead_parts_s.items()},
              "nvml_init_s": prof.nvml_init_s}
    lines = ["| what | ms per call |", "|---|---|", f"| MemoryProfiler.record | {result['record_ms']:.3f} |"]
    lines += [f"| record: {k} part | {v:.3f} |" for k, v in result["record_parts_ms"].items()]
    if cuda:
        four = lambda: (torch.cuda.max_memory_allocated(0), torch.cuda.memory_allocated(0),  # noqa: E731
                        torch.cuda.memory_reserved(0), torch.cuda.reset_peak_memory_stats(0))
        nested = lambda: (torch.cuda.memory_stats_as_nested_dict(0), torch.cuda.reset_peak_memory_stats(0))  # noqa: E731
        result["allocator_reads_ms"] = {"four getters": _per_call_ms(four, args.records),
                                        "one nested read": _per_call_ms(nested, args.records)}
        lines += [f"| allocator statistics, {k} | {v:.3f} |" for k, v in result["allocator_reads_ms"].items()]
        del keep
    result["table_markdown"] = "\n".join(lines)
    print(result["table_markdown"])
    out = Path(args.json) if args.json else None
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
