"""What the checkpoint's content digests cost: XXH3-64 taken while the files are written, against the whole save.

Builds a model (default GPT-2 124M) under ZeRO ``--stage`` (default 1) with AdamW on this machine's accelerator
(CPU here), takes one optimizer step so the Adam state exists, saves one warm-up checkpoint (not counted), then
``--saves`` rounds of one save per variant, in an order that rotates every round:

* ``xxh3``:   what ``save_checkpoint`` does: every file hashed (XXH3-64) while it is written (``HashingWriter``);
* ``null``:   the same writes through the same writer, with a hasher that does nothing: the save without digests;
* ``native``: DeepSpeed's own write (``torch.save`` to a path, torch's C++ file writer), no digests at all.

The cost of the digests is each round's ``xxh3`` save over the same round's ``null`` save (paired by round, so a
slow stretch of the machine hits both), minus 1.

Each save is timed whole and in parts: DeepSpeed's save (its files), the rank file, the read-back of any file not
hashed while written, ``write_manifest`` (fsync of every file, then the manifest) and ``publish`` (renames,
``latest``); for ``xxh3`` also the time spent inside the hasher. After each ``xxh3`` save the load's check of every
file (``verify_files``) is timed with and without the digests. Every save's folder is removed after it.

    .venv/bin/python benchmarks/checkpoint_digest_cost.py --saves 30 --json docs/results/checkpoint-digest-cost.json
    .venv/bin/python benchmarks/checkpoint_digest_cost.py --model llama-1b --stage 0 --saves 8 \
        --json docs/results/checkpoint-digest-cost-1b.json

(The 1B model in fp32 under ZeRO 0 fits 24 GB of host memory: 4.4 GB of weights and 8.8 GB of Adam state.)

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("xxh3", "null", "native")
PARTS = ("deepspeed_write_s", "rank_file_s", "read_back_s", "manifest_and_fsync_s", "publish_s")


def _meminfo_mb(*keys: str) -> dict[str, float]:
    """Dirty / Writeback page-cache totals (MB) from /proc/meminfo: what a save leaves to flush."""
    out = {}
    with open("/proc/meminfo") as fh:
        for line in fh:
            name, value = line.split(":", 1)
            if name in keys:
                out[name] = int(value.split()[0]) / 1024
    return out


class NullHasher:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--saves", type=int, default=3, help="rounds (each: one save of every variant)")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the model's own)")
    p.add_argument("--seq", type=int, default=128, help="sequence length of the one training step")
    p.add_argument("--dir", type=Path, default=None, help="where to save (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    import torch
    import ds_hybrid
    from ds_hybrid import checkpoint as ckpt
    from ds_hybrid.models import build_model
    from ds_hybrid.dist_env import ensure_distributed_env
    from ds_hybrid.train import quiet_logs
    ensure_distributed_env()
    quiet_logs(False)
    torch.manual_seed(0)
    model = build_model(args.model, vocab_size=args.vocab, seq_len=args.seq)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    engine, *_ = ds_hybrid.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, vocab, (1, args.seq), device=engine.device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    for p_ in model.parameters():   # the gradients are not saved: free them (the 1B model then fits host memory)
        p_.grad = None

    spent: dict[str, float] = {}

    def add(part: str, t0: float) -> None:
        spent[part] = spent.get(part, 0.0) + time.perf_counter() - t0

    def timed(part: str, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                add(part, t0)
        return run

    records_writes = ckpt.records_writes

    @contextlib.contextmanager
    def timed_records_writes(*a, **k):
        t0 = time.perf_counter()
        with records_writes(*a, **k):
            yield
        add("deepspeed_write_s", t0)

    real_hasher, real_digest_file = ckpt.new_hasher, ckpt.digest_file

    class TimedHasher:
        def __init__(self):
            self._h = real_hasher()

        def update(self, data) -> None:
            t0 = time.perf_counter()
            self._h.update(data)
            add("hash_s", t0)

        def hexdigest(self) -> str:
            return self._h.hexdigest()

    ckpt.records_writes = timed_records_writes
    ckpt.torch_save_atomic = timed("rank_file_s", ckpt.torch_save_atomic)
    ckpt.write_manifest = timed("manifest_and_fsync_s", ckpt.write_manifest)
    ckpt.publish = timed("publish_s", ckpt.publish)
    ce = engine.checkpoint_engine

    def use(variant: str) -> None:
        vars(ce).pop("save", None)
        ckpt.new_hasher = TimedHasher if variant == "xxh3" else NullHasher
        ckpt.digest_file = timed("read_back_s", real_digest_file if variant == "xxh3" else
                                 (lambda path: "0" * 16))
        if variant == "native":   # the engine's own save: an instance attribute, so not replaced by ours
            ce.save = ce.save

    root = args.dir or Path(tempfile.mkdtemp(prefix="digest-cost-"))
    k = len(VARIANTS)
    order = [("warm-up", "native")] + [(i, VARIANTS[(j + i) % k]) for i in range(args.saves) for j in range(k)]
    rows = []
    for n, (round_, variant) in enumerate(order):
        use(variant)
        spent.clear()
        before = _meminfo_mb("Dirty", "Writeback")
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root), tag=f"s{n}")
        save_s = time.perf_counter() - t0
        tag_dir = root / f"s{n}"
        row = {"round": round_, "variant": variant, "save_s": save_s, **{k: spent.get(k, 0.0) for k in PARTS},
               "hash_s": spent.get("hash_s", 0.0),
               "bytes": sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file()),
               "dirty_mb_before": before.get("Dirty"), "writeback_mb_before": before.get("Writeback")}
        if variant == "xxh3":
            t0 = time.perf_counter()
            ckpt.verify_files(tag_dir, verify=True)
            row["load_check_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ckpt.verify_files(tag_dir, verify=False)
            row["load_check_without_digests_s"] = time.perf_counter() - t0
        rows.append(row)
        shutil.rmtree(tag_dir)
    use("xxh3")
    ckpt.new_hasher, ckpt.digest_file = real_hasher, real_digest_file
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)

    counted = [r for r in rows if r["round"] != "warm-up"]
    summary: dict = {}
    for v in VARIANTS:
        s = [r["save_s"] for r in counted if r["variant"] == v]
        summary[v] = {"saves": len(s), "save_mean_s": statistics.mean(s), "save_min_s": min(s), "save_max_s": max(s)}
    by_round = {(r["round"], r["variant"]): r for r in counted}
    hashed = [r for r in counted if r["variant"] == "xxh3"]
    # each round's save with the digests over the same round's save without (paired: a slow stretch hits both)
    paired = [r["save_s"] / by_round[(r["round"], "null")]["save_s"] - 1 for r in hashed]
    summary["xxh3"].update(
        hash_mean_s=statistics.mean(r["hash_s"] for r in hashed),
        read_back_mean_s=statistics.mean(r["read_back_s"] for r in hashed),
        # the time inside the hasher over the same save's whole time, per save
        hash_share_of_save_mean=statistics.mean(r["hash_s"] / r["save_s"] for r in hashed),
        hash_share_of_save_max=max(r["hash_s"] / r["save_s"] for r in hashed),
        vs_null_mean=statistics.mean(paired), vs_null_min=min(paired), vs_null_max=max(paired),
        vs_null_sd=statistics.stdev(paired) if len(paired) > 1 else 0.0,
        # the standard error of the mean: the paired cost is known to about twice this
        vs_null_se=statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else 0.0,
        load_check_mean_s=statistics.mean(r["load_check_s"] for r in hashed),
        load_check_without_digests_mean_s=statistics.mean(r["load_check_without_digests_s"] for r in hashed))

    print("| save | round | variant | GB | save s | DeepSpeed write s | rank file s | read-back s | fsync+manifest s "
          "| publish s | in the hasher s | dirty MB before | load check s (without digests) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in enumerate(rows):
        check = f"{r['load_check_s']:.3f} ({r['load_check_without_digests_s']:.3f})" if "load_check_s" in r else "-"
        print(f"| {n} | {r['round']} | {r['variant']} | {r['bytes'] / 1e9:.2f} | {r['save_s']:.2f} | "
              + " | ".join(f"{r[k]:.3f}" for k in PARTS) + f" | {r['hash_s']:.3f} | {r['dirty_mb_before']:.0f} | {check} |")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v}: mean save {s['save_mean_s']:.2f} s ({s['save_min_s']:.2f}-{s['save_max_s']:.2f}, {s['saves']} saves)")
    h = summary["xxh3"]
    print(f"xxh3: {h['hash_mean_s']:.3f} s in the hasher per save, {100 * h['hash_share_of_save_mean']:.1f}% of the "
          f"save (at most {100 * h['hash_share_of_save_max']:.1f}%); the save against the same round's null save "
          f"{100 * h['vs_null_mean']:+.1f}% (standard error {100 * h['vs_null_se']:.1f}, sd {100 * h['vs_null_sd']:.1f}, "
          f"{100 * h['vs_null_min']:+.1f} to {100 * h['vs_null_max']:+.1f}); read back at save time "
          f"{h['read_back_mean_s']:.3f} s; load check {h['load_check_mean_s']:.2f} s "
          f"({h['load_check_without_digests_mean_s']:.3f} s without)")
    if args.json:
        args.json.write_text(json.dumps({"command": "benchmarks/checkpoint_digest_cost.py " + " ".join(sys.argv[1:]),
                                         "model": args.model, "parameters": n_params, "stage": args.stage,
                                         "device": str(engine.device), "digest": "xxh3_64",
                                         "rows": rows, **summary}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
