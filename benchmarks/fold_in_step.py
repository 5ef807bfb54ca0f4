"""A real step's host work under ZeRO-Offload with the hybrid's passes inline and inside the step.

Under ZeRO-Offload a drift real step adds to DeepSpeed's CPU Adam step the fold of its update into
the int8 velocity (read back from the moments the step left) and, after a kept Predict run, the
commit of the run into the fp32 masters. As passes of their own (inline, or on a host thread
behind the step) each reads the partition again from DRAM; inside the step
(``memory.fold_in_step``, ``ds_hybrid/step_fusion.py``) they run a chunk at a time beside each
chunk's Adam update, while its values are in cache, or in one pass with DeepSpeed's update
(each block of 256 values: commit, update, fold, ``host_kernels.adam_fold``; the fold takes the
block's own displacement, its weights copied before the update). This times, on one partition of ``--values``
values, best of ``--repeat`` with the arms interleaved: DeepSpeed's CPU Adam step alone, the step
with the fold (and the commit of a 3-step run) as passes after (before) it, and the same inside
the step in one pass and at each ``--chunks`` size through DeepSpeed's op, each over the step
alone, and the one pass reading the int8 noise from its table (4 bytes a value) instead of computing
it, and the one pass reading the update back from the moments the step left (the fold after the
step's way: three divisions and a square root a value more; the one pass's way until 2026-11-29).
The velocity is int8 (the 1b-16gb and 7b presets'); each other dtype of ``--velocity``
adds its fold after the step and inside it, in one pass, both ways. ``--no-moments``: the fold without the
moment sums only the RSSM predictor reads (the default ``adam_direction`` predictor's fold).

(What the GPU adds, the backward's host work beside a pass on a thread, needs a GPU: stage
``grad1b``, ``drift-int8-device-next-behind`` against ``drift-int8-device-fused``.)

    python benchmarks/fold_in_step.py --values 67108864 --repeat 5 --json docs/results/fold-in-step.json
    python benchmarks/fold_in_step.py --values 67108864 --repeat 5 --chunks 20 --velocity int8 bf16 fp32 \
        --no-moments --json docs/results/fold-in-step-velocity.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_path import write_result  # noqa: E402  (the same record)

from ds_hybrid import host_kernels, step_fusion  # noqa: E402
from ds_hybrid.quant import CompactBuffer  # noqa: E402

COEFS = [-1e-4, -1e-4, -1e-4]   # a kept run of three drift steps


def _arms(n: int, chunks: list[int], dtypes: tuple[str, ...] = ("int8",), moments: bool = True):
    """(name, setup for one timed call) for every arm, over one shared optimizer and a velocity per dtype."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=g) * 0.02)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    fused = step_fusion.install(opt)
    p.grad = torch.randn(n, generator=g) * 1e-3
    opt.step()   # the moments exist
    vels = {}
    for d in dtypes:
        vels[d] = CompactBuffer(n, d, "cpu")
        vels[d].store(torch.randn(n, generator=g) * 1e-3, generator=g)
    vel = vels[dtypes[0]]
    group = opt.param_groups[0]

    def hyper() -> dict:
        return dict(step=opt.state[p]["step"], lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                    eps=group["eps"], weight_decay=group["weight_decay"], bias_correction=group["bias_correction"])

    def fold_job(d: str, read_noise: bool = False, from_moments: bool = False) -> step_fusion.FoldJob:
        job = step_fusion.FoldJob(lambda: vels[d], n, d, torch.Generator().manual_seed(1), 0.9, False, moments, True)
        job.read_noise = read_noise
        job.displacement = not from_moments
        return job

    def job(commit: bool, d: str, read_noise: bool = False, from_moments: bool = False) -> step_fusion.PartitionJob:
        j = step_fusion.PartitionJob(0, 0, p.data)
        j.fold = fold_job(d, read_noise, from_moments)
        j.commit = (vel, COEFS) if commit else None
        return j

    def inline(commit: bool, d: str = dtypes[0]):
        def run():
            if commit:
                host_kernels.shift(p.data, vel, COEFS)
            opt.step()
            st = opt.state[p]
            fold_job(d).run(p.data, st["exp_avg"], st["exp_avg_sq"], 0, n, hyper())
        return run

    def in_step(commit: bool, chunk: int | None, d: str = dtypes[0], read_noise: bool = False,
                from_moments: bool = False):
        def run():
            fused.one_pass = chunk is None
            fused.chunk = chunk or step_fusion.CHUNK
            fused.arm([job(commit, d, read_noise, from_moments)])
            opt.step()
            assert not fused.disarm()
        return run

    arms = [("DeepSpeed CPU Adam step", opt.step), ("+ fold, a pass after the step", inline(False)),
            ("+ commit and fold, passes around the step", inline(True))]
    arms += [("+ fold inside the step, one pass", in_step(False, None)),
             ("+ commit and fold inside the step, one pass", in_step(True, None)),
             ("+ fold inside the step, one pass, its update read back from the moments",
              in_step(False, None, from_moments=True))]
    if dtypes[0] == "int8":   # the int8 noise's table values read (4 bytes a value) where the one pass computes them
        arms += [("+ fold inside the step, one pass, int8 noise read", in_step(False, None, read_noise=True))]
    for c in chunks:
        arms += [(f"+ fold inside the step, chunks of 2^{c.bit_length() - 1}", in_step(False, c)),
                 (f"+ commit and fold inside the step, chunks of 2^{c.bit_length() - 1}", in_step(True, c))]
    for d in dtypes[1:]:
        arms += [(f"+ fold, a pass after the step, {d} velocity", inline(False, d)),
                 (f"+ fold inside the step, one pass, {d} velocity", in_step(False, None, d)),
                 (f"+ fold inside the step, one pass, {d} velocity, its update read back from the moments",
                  in_step(False, None, d, from_moments=True))]
    return arms


def measure(n: int, repeat: int, chunks: list[int], dtypes: tuple[str, ...] = ("int8",),
            moments: bool = True) -> dict[str, float]:
    arms = _arms(n, chunks, dtypes, moments)
    for _, fn in arms:
        fn()   # warm: pages touched, kernels built
    best = {name: float("inf") for name, _ in arms}
    for _ in range(repeat):
        for name, fn in arms:   # interleaved: a drift of the machine's speed spreads over every arm
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", type=int, default=1 << 26, help="values in the partition (default 2^26)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunks", default="18,20,22", help="log2 of the chunk sizes tried (default 18,20,22)")
    ap.add_argument("--velocity", nargs="+", default=["int8"], choices=["int8", "bf16", "fp32"],
                    help="velocity dtypes: the first for every arm, each other for its fold after and inside the step")
    ap.add_argument("--no-moments", dest="moments", action="store_false",
                    help="the fold without the moment sums (what the default adam_direction predictor folds)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    try:
        chunks = [1 << int(c) for c in args.chunks.split(",")]
    except ValueError:
        raise SystemExit(f"--chunks: comma-separated log2 sizes, got {args.chunks!r}") from None
    if args.values < 1 or args.repeat < 1 or any(c % host_kernels.FOLD_GROUP for c in chunks):
        raise SystemExit(f"--values, --repeat: at least 1; --chunks: at least {host_kernels.FOLD_GROUP.bit_length() - 1}")
    host_kernels.load()
    best = measure(args.values, args.repeat, chunks, tuple(dict.fromkeys(args.velocity)), args.moments)
    adam = best["DeepSpeed CPU Adam step"]
    rows = [{"arm": k, "ms": v * 1e3, "over_cpu_adam": v / adam} for k, v in best.items()]
    table = "\n".join(["| arm | ms | over the step alone |", "|---|---|---|"] +
                      [f"| {r['arm']} | {r['ms']:.1f} | {r['over_cpu_adam']:.2f}x |" for r in rows])
    print(table)
    return write_result("fold_in_step.py", argv if argv is not None else sys.argv[1:], args, rows, table)


if __name__ == "__main__":
    main(sys.argv[1:])
