"""Saves checkpoints until one save holds still at ``--hold``, where the test kills it with SIGKILL.

Started by tests/test_faults.py as one process (world size 1). It trains three steps,
saving after each (tags step1..step3, each reported with ``SAVED <tag> <global_steps>``),
trains a fourth step and saves ``step4`` with a pause at one point of the save:

* ``deepspeed-files``: DeepSpeed has written its first file into the staging folder
* ``before-publish``:  every file and the manifest are written, the folder not yet renamed
* ``before-latest``:   the folder is renamed to ``step4``, ``latest`` still names step3

It prints ``HOLDING <point>`` and sleeps; the test kills it there.
"""
import argparse
import time

from ds_hybrid import checkpoint as ckpt
from engine_utils import EAGER, Batches, ds_config, make_engine

parser = argparse.ArgumentParser()
parser.add_argument("--save-dir", required=True)
parser.add_argument("--hold", choices=["deepspeed-files", "before-publish", "before-latest"], required=True)
args = parser.parse_args()


def hold() -> None:
    print(f"HOLDING {args.hold}", flush=True)
    time.sleep(600)  # killed long before this ends


engine = make_engine(ds_config(stage=2, hybrid=EAGER))
batches = Batches()
for step in range(1, 4):
    engine.train_step(batches.step())
    engine.save_checkpoint(args.save_dir, f"step{step}")
    print(f"SAVED step{step} {engine.global_steps}", flush=True)
engine.train_step(batches.step())

if args.hold == "deepspeed-files":
    # DeepSpeed's checkpoint engine writes its files through this (hashing them as they are written)
    write = ckpt.torch_save_hashed

    def save_then_hold(obj, path, **kwargs):
        write(obj, path, **kwargs)
        hold()

    ckpt.torch_save_hashed = save_then_hold
elif args.hold == "before-publish":
    ckpt.publish = lambda *a, **k: hold()
else:
    write_text = ckpt.write_text_atomic

    def hold_before_latest(path, text):
        if path.name == ckpt.LATEST_FILE:
            hold()
        write_text(path, text)

    ckpt.write_text_atomic = hold_before_latest
engine.save_checkpoint(args.save_dir, "step4")
print("SAVE RETURNED (the hold point was never reached)", flush=True)
