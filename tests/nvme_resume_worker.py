"""One process of the NVMe resume test (tests/test_nvme_resume.py): ZeRO 3 with ``offload_optimizer:
nvme`` (gpt2-tiny in sub-groups DeepSpeed swaps), saved by one process and loaded by a fresh one,
as a user resumes a run.

``--role save`` trains (with ``--hybrid``: into a drift Predict run on the device path, one step
into it; ``--gradient``: a gradient run), saves a checkpoint, writes its batch stream's state
beside it, then takes ``--after`` more steps. ``--role load`` builds the engine from other
initial weights with its own swap folder, loads the checkpoint, takes up the batch stream where
it was saved and takes the same steps. Each rank (one, or several under ``run_ranks``: each with
its own micro-batches) writes ``rank<r>.json``: the steps after the save (phase, loss), the Adam
state keys and the pending run's length right after the save or load, and a digest of the
weights at the end. ``--plain``: plain ``deepspeed.initialize`` and its own ``load_checkpoint``.
"""
import argparse
import hashlib
import json
import os

import torch

import ds_hybrid.zero_access as za
from engine_utils import EAGER, NVME_AIO, SWAPPED_LLAMA, Batches, ds_config, full_params, make_engine, swap_params

p = argparse.ArgumentParser()
p.add_argument("--role", choices=["save", "load"], required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--swap", required=True)
p.add_argument("--hybrid", action="store_true")
p.add_argument("--plain", action="store_true")
p.add_argument("--gradient", action="store_true", help="with --hybrid: predictor.direction gradient (else drift)")
p.add_argument("--params-nvme", action="store_true",
               help="SWAPPED_LLAMA in bf16 with offload_param: nvme too (engine_utils.swap_params)")
p.add_argument("--after", type=int, default=4)
p.add_argument("--out", required=True)
args = p.parse_args()

hybrid = dict(EAGER, correction_steps=0, check="next_step",
              predictor={"direction": "gradient" if args.gradient else "drift"},
              memory={"offload_predict": "device"}) if args.hybrid else None
if args.params_nvme:
    cfg = swap_params(ds_config(stage=3, bf16=True, offload_opt="nvme", offload_param="nvme", nvme_path=args.swap,
                                hybrid=hybrid, **NVME_AIO))
    model = SWAPPED_LLAMA
else:
    cfg = ds_config(stage=3, offload_opt="nvme", nvme_path=args.swap, hybrid=hybrid, **NVME_AIO)
    cfg["zero_optimization"]["sub_group_size"] = 420_000   # (two sub-groups, both swapped)
    model = dict(model="gpt2-tiny")
rank = int(os.environ.get("RANK", "0"))
engine = make_engine(cfg, plain=args.plain, seed=0 if args.role == "save" else 1, **model)
batches = Batches(seed=3, rank=rank)
stream = os.path.join(args.ckpt, f"batch_stream{rank}.pt")


def step() -> dict:
    if args.plain:
        loss = engine(**batches.micro()).loss
        engine.backward(loss)
        engine.step()
        return {"phase": "plain", "loss": float(loss)}
    r = engine.train_step(batches.step())
    return {"phase": r.phase, "loss": r.loss}


def run():
    """The hybrid's device path: the drift run's or the gradient run's state."""
    return engine._gradient if args.gradient else engine._device_predict


def adam_keys() -> list:
    return [sorted(part.state) for part in za.master_access(engine).partitions()]


if args.role == "save":
    if args.hybrid:
        while engine.controller.phase.value != "predict":
            step()
        step()
        assert run().pending, "the save is to be in the middle of a run"
    else:
        for _ in range(5):
            step()
    engine.save_checkpoint(args.ckpt, tag="t")
    torch.save(batches.gen.get_state(), stream)
else:
    engine.load_checkpoint(args.ckpt, tag="t")
    batches.gen.set_state(torch.load(stream))
keys = adam_keys()
# (the run's steps taken so far; the gradient run's first moment: 1)
pending = (int(run().pending) if args.gradient else len(run().pending)) if args.hybrid else None
record = [step() for _ in range(args.after)]
digest = hashlib.sha256(b"".join(t.float().numpy().tobytes() for t in full_params(engine))).hexdigest()
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"record": record, "adam_keys": keys, "weights_sha256": digest, "pending": pending}, f)
print(f"RANK{rank} DONE", flush=True)
