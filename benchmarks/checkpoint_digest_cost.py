"""What the checkpoint's content digests cost: CRC-32 time against the whole save, and the load check.

Builds a model (default GPT-2 124M) under ZeRO 1 with AdamW on this machine's accelerator (CPU here), takes one
optimizer step so the Adam state exists, then saves ``--saves`` checkpoints, timing the save and, inside it, the
digesting (each rank's CRC-32 of its own files right after writing them, and rank 0's of any others), then the
load's check of every file (``verify_files``).

    .venv/bin/python benchmarks/checkpoint_digest_cost.py --json docs/results/checkpoint-digest-cost.json

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--saves", type=int, default=3)
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
    model = build_model(args.model, vocab_size=256, seq_len=128)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = ds_hybrid.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    x = torch.randint(0, 256, (1, 128), device=engine.device)
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()

    spent = {"digest": 0.0}   # time in the CRC-32s of the files this rank wrote
    own, crc = ckpt._digest_own_files, ckpt.crc32_file

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return own(*a, **k)
        finally:
            spent["digest"] += time.perf_counter() - t0
    ckpt._digest_own_files = timed
    root = args.dir or Path(tempfile.mkdtemp(prefix="digest-cost-"))
    rows = []
    # Saves with the digests and without them (CRC-32 replaced by a constant) alternate, so the
    # difference of their times is what the digests cost, whatever of them overlaps the writing.
    for i in range(2 * args.saves):
        digests = i % 2 == 0
        ckpt.crc32_file = crc if digests else (lambda path, chunk=0: "00000000")
        spent["digest"] = 0.0
        t0 = time.perf_counter()
        engine.save_checkpoint(str(root), tag=f"s{i}")
        save_s = time.perf_counter() - t0
        tag_dir = root / f"s{i}"
        size = sum(f.stat().st_size for f in tag_dir.rglob("*") if f.is_file())
        row = {"digests": digests, "save_s": save_s, "digest_wait_s": spent["digest"], "bytes": size}
        if digests:
            t0 = time.perf_counter()
            ckpt.verify_files(tag_dir, verify=True)
            row["load_check_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ckpt.verify_files(tag_dir, verify=False)
            row["load_check_without_digests_s"] = time.perf_counter() - t0
        rows.append(row)
        shutil.rmtree(tag_dir)
    ckpt.crc32_file = crc
    with_d = [r["save_s"] for r in rows if r["digests"]]
    without = [r["save_s"] for r in rows if not r["digests"]]
    digest_s = [r["digest_wait_s"] for r in rows if r["digests"]]
    # DeepSpeed's own write of the same checkpoint varies by 2x between saves here (page cache),
    # so the difference of the two means is noise-dominated; the share below is the CRC-32 time
    # over the rest of the same saves.
    summary = {"save_with_digests_s": sum(with_d) / len(with_d), "save_without_digests_s": sum(without) / len(without),
               "digest_s": sum(digest_s) / len(digest_s)}
    summary["digest_share_of_save"] = sum(digest_s) / (sum(with_d) - sum(digest_s))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    print("| save | digests | checkpoint GB | save s | time in the digests s | load check s (without digests) |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        check = f"{r['load_check_s']:.2f} ({r['load_check_without_digests_s']:.2f})" if r["digests"] else "-"
        print(f"| {i} | {'yes' if r['digests'] else 'no'} | {r['bytes'] / 1e9:.2f} | {r['save_s']:.2f} | "
              f"{r['digest_wait_s']:.2f} | {check} |")
    print(f"mean save {summary['save_with_digests_s']:.2f} s with the digests ({summary['digest_s']:.2f} s of them: "
          f"{100 * summary['digest_share_of_save']:.0f}% of the rest of those saves), "
          f"{summary['save_without_digests_s']:.2f} s without")
    if args.json:
        args.json.write_text(json.dumps({"command": "benchmarks/checkpoint_digest_cost.py " + " ".join(sys.argv[1:]),
                                         "model": args.model, "device": str(engine.device), "rows": rows, **summary}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
