"""A gradient Predict run's host work, timed: its commit (what the real step after the run waits for)
and, where the 16-bit partition lives in host memory, each of its steps' update.

Under ZeRO-Offload the device path's commit writes the run's first moment into the optimizer's
``exp_avg`` and catches the fp32 masters up with the 16-bit weights the run moved
(``grad_predict.GradientPredict._hand_over``). On an H200 with llama-1b (970M values, 16 cores) a
real step after a run waited 538 ms for it and its host thread slowed the step's backward and CPU
Adam step (``docs/results/offload-gpu-1b-grad-2026-11-26.json``). This times the host side of it
on one partition of ``--values`` values, best of ``--repeat``: the catch-up with the torch ops and
with ``kernels/host_fold.cpp`` (``host_kernels.catch_up``), and the first moment's bf16 -> fp32
hand-over, each per value and over DeepSpeed's own CPU Adam step on as many values. (The PCIe part
of the commit, 4 bytes a value through the stager's pinned chunks, needs a GPU: stage ``grad1b``.)

With ZeRO 3's ``offload_param: cpu`` (the ``7b-24gb`` layout) every Predict step's held Adam
update moves a bf16 partition in host memory: timed with the torch ops
(``kernels.held_adam_step_reference``, whose random bits' int64 hash is most of it; on the H200
the ``gradz3`` stage's gradient run did not finish 24 steps of llama-1b in 4 minutes) and with the
C++ pass (``host_kernels.held_adam``), fp32 moments.

    python benchmarks/grad_commit.py --values 67108864 --repeat 5 --json docs/results/grad-commit.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_path import _best, cpu_adam_step, write_result  # noqa: E402  (the same timer, step and record)

from ds_hybrid import host_kernels, kernels  # noqa: E402
from ds_hybrid.grad_predict import _catch_up  # noqa: E402


def measure(n: int, repeat: int) -> dict:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g) * 0.02
    moved = (master + torch.randn(n, generator=g) * 1e-3).to(torch.bfloat16)
    run_m = (torch.randn(n, generator=g) * 1e-4).to(torch.bfloat16)
    exp_avg = torch.empty(n)
    work = master.clone()
    out = {}
    for hk in (False, True):
        out["catch_up" + ("_cpp" if hk else "_torch")] = _best(lambda: _catch_up(work, moved, host_kernel=hk), repeat,
                                                               setup=lambda: work.copy_(master))
    out["first_moment_hand_over"] = _best(lambda: exp_avg.copy_(run_m), repeat)
    # a Predict step's update of a bf16 partition in host memory (moments fp32, as auto keeps them there)
    m, v = torch.randn(n, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-8
    x = moved.clone()
    bc1, bc2 = kernels._bias_corrections(0.9, 0.95, 10, True)
    out["held_adam_step_torch"] = _best(lambda: kernels.held_adam_step_reference(
        x, m, v, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, step=10, weight_decay=0.1, decoupled=True, key=1), repeat)
    out["held_adam_step_cpp"] = _best(lambda: host_kernels.held_adam(
        x, m, v, lr=1e-4, bc1=bc1, bc2=bc2, eps=1e-8, decay=-1e-5, key=1), repeat)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 26, help="values in the partition (default 2^26)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.values < 1 or args.repeat < 1:
        raise SystemExit("--values and --repeat: must be at least 1")
    host_kernels.load()   # built before anything is timed
    adam = cpu_adam_step(args.values, args.repeat)
    rows = [{"part": k, "ms": v * 1e3, "ns_per_value": v / args.values * 1e9, "over_cpu_adam": v / adam}
            for k, v in measure(args.values, args.repeat).items()]
    table = "\n".join(["| part | ms | ns per value | over DeepSpeed's CPU Adam step |", "|---|---|---|---|",
                       f"| DeepSpeed CPU Adam step | {adam * 1e3:.1f} | {adam / args.values * 1e9:.2f} | 1.00x |"] +
                      [f"| {r['part']} | {r['ms']:.1f} | {r['ns_per_value']:.2f} | {r['over_cpu_adam']:.2f}x |"
                       for r in rows])
    print(table)
    return write_result("grad_commit.py", argv if argv is not None else sys.argv[1:], args, rows, table,
                        cpu_adam_ms=adam * 1e3)


if __name__ == "__main__":
    main(sys.argv[1:])
