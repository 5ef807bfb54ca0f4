"""What the non-finite guard costs a real step: the bench's plain DeepSpeed baseline against DeepSpeed's own step.

The bench's `baseline` arm trains through ``ds_hybrid.initialize`` with ``hybrid_predict.enabled: false``: DeepSpeed's
forward, backward and step, plus the engine's guard (a hook on every gradient and one all-reduce of the losses and a
NaN/Inf flag per step, so that every rank skips a non-finite step together). This script times the suite's model,
data and config, round robin in one process (a slow stretch of the machine lands on every variant alike):

* ``guard``: the bench's baseline, ``train_step`` of a ``PredictiveEngine`` with the hybrid off, its guard as shipped
  (each gradient's fp32 sum added to a running total);
* ``guard-previous``: the same engine with the guard's earlier hook (``~isfinite(grad).all()`` per gradient, or-ed
  into a flag), which every bench figure before 2026-11-24 was measured with, the baseline's included;
* ``no-guard``: the same engine with the guard's hooks taken off (what the rest of ``train_step`` costs);
* ``direct``: the same engine with the guard as shipped, driven as DeepSpeed's own is (``engine(**batch).loss;
  backward; step``) instead of through ``train_step``: what the wrapper's Python around the step costs;
* ``deepspeed``: ``deepspeed.initialize``'s engine (no ds_hybrid code), ``engine(**batch).loss; backward; step``.
  A second engine holds its own copy of the model and optimizer state, placed elsewhere in memory; on this machine
  that alone moves a step's time by a few %, so only the first three, which swap guards on one engine, compare
  closely;
* ``deepspeed-2``: a second ``deepspeed.initialize`` engine, identical to the first: how far two identical engines'
  steps differ by where they sit in memory alone.

    .venv/bin/python benchmarks/guard_cost.py --json docs/results/guard-cost.json

Per variant: the median step time over ``--rounds`` rounds of ``--steps`` steps, and the median (and quartiles) of
each round's time over the same round's ``no-guard`` time and ``deepspeed`` time. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ds_hybrid import engine as E  # noqa: E402

VARIANTS = ("guard", "guard-previous", "no-guard", "direct", "deepspeed", "deepspeed-2")


class PreviousGuard(E._NonFiniteGuard):
    """The guard's hook before 2026-11-24: an element-wise finiteness check per gradient."""

    def __init__(self, module: torch.nn.Module):
        self._grad_bad: torch.Tensor | None = None
        super().__init__(module)

    def _check_grad(self, grad: torch.Tensor) -> None:
        bad = ~torch.isfinite(grad).all()
        self._grad_bad = bad.clone() if self._grad_bad is None else self._grad_bad | bad.to(self._grad_bad.device)

    def collect(self):
        loss_sum, count, bad = super().collect()
        flag, self._grad_bad = self._grad_bad, None
        return loss_sum, count, bad or bool(flag is not None and flag)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="cpu-small")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="steps per variant per round")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import deepspeed
    from ds_hybrid import initialize
    from ds_hybrid.arguments import resolve_config
    from ds_hybrid.bench_arms import deep_merge
    from ds_hybrid.bench_suites import SUITES
    from ds_hybrid.data import ByteDataset, train_batches
    from ds_hybrid.dist_env import ensure_distributed_env
    from ds_hybrid.models import build_model, layer_groups
    from ds_hybrid.train import quiet_logs

    ensure_distributed_env()
    quiet_logs(False)
    suite = SUITES[args.suite]
    preset, _ = resolve_config(suite.config)
    cfg = deep_merge(preset, suite.overrides)
    plain_cfg = copy.deepcopy(cfg)
    plain_cfg.pop("hybrid_predict", None)
    cfg["hybrid_predict"] = {"enabled": False}

    def build(init, config):
        torch.manual_seed(0)
        model = build_model(suite.model, vocab_size=256, seq_len=suite.seq_len)
        return init(model=model, model_parameters=layer_groups(model, suite.layer_groups), config=config)[0]

    ours = build(initialize, cfg)
    plain = build(deepspeed.initialize, plain_cfg)
    plain2 = build(deepspeed.initialize, plain_cfg)
    def use(name: str) -> None:
        """Put the variant's guard on the one hybrid-off engine."""
        ours._guard.remove()
        ours._guard = (PreviousGuard if name == "guard-previous" else E._NonFiniteGuard)(ours.module)
        if name == "no-guard":
            ours._guard.remove()   # collect() still runs at the boundary, over the losses alone

    train, _ = ByteDataset.load(None).split(seq_len=suite.seq_len)
    stream = train_batches(train, suite.seq_len, ours.train_micro_batch_size_per_gpu(), seed=0)
    batches = [next(stream) for _ in range(args.steps)]

    def step(name: str, batch: dict) -> None:
        if name in ("deepspeed", "deepspeed-2", "direct"):
            eng = {"deepspeed": plain, "deepspeed-2": plain2, "direct": ours}[name]
            loss = eng(**batch).loss
            eng.backward(loss)
            eng.step()
            loss.item()
        else:
            ours.train_step([batch])

    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(args.rounds + 2):
        order = VARIANTS if r % 2 else VARIANTS[::-1]
        for name in order:
            if name not in ("deepspeed", "deepspeed-2"):
                use("guard" if name == "direct" else name)
            t0 = time.perf_counter()
            for b in batches:
                step(name, b)
            if r >= 2:   # two rounds of warm-up (allocator, Adam state)
                times[name].append((time.perf_counter() - t0) / len(batches))
    out = {"command": "python benchmarks/guard_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "suite": args.suite, "model": suite.model, "rounds": args.rounds, "steps_per_round": args.steps,
           "threads": torch.get_num_threads(), "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
           "variants": {}}
    for name in VARIANTS:
        row = {"median_step_ms": 1e3 * statistics.median(times[name])}
        for ref in ("no-guard", "deepspeed"):   # each round's time over the same round's reference
            ratios = sorted(a / b for a, b in zip(times[name], times[ref]))
            q = statistics.quantiles(ratios, n=4)
            row[f"over_{ref}_median"], row[f"over_{ref}_quartiles"] = statistics.median(ratios), [q[0], q[2]]
        out["variants"][name] = row
    print(f"{'variant':<16} {'step ms':>8} {'over no-guard: median (quartiles)':>34} {'over DeepSpeed':>24}")
    for name, v in out["variants"].items():
        a, b = v["over_no-guard_quartiles"], v["over_deepspeed_quartiles"]
        print(f"{name:<16} {v['median_step_ms']:>8.1f} {v['over_no-guard_median']:>14.3f}x ({a[0]:.3f}-{a[1]:.3f}) "
              f"{v['over_deepspeed_median']:>10.3f}x ({b[0]:.3f}-{b[1]:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
