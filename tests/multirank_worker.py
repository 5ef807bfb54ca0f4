"""One rank of the multi-rank test: trains, then writes what it saw to a JSON file.

Run by tests/test_multirank.py as N processes with RANK / WORLD_SIZE / MASTER_PORT set.
Rank 1 reports a loss 10x too high on one Predict verification: the all-reduced
decision must roll back on every rank, not only on rank 1.
"""
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from ds_hybrid import Phase
from ds_hybrid.engine import default_loss
from engine_utils import EAGER, Batches, ds_config, full_params, make_engine

stage, out_dir, steps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
rank = int(os.environ["RANK"])
engine = make_engine(ds_config(stage=stage, hybrid=dict(EAGER, min_predict_steps=3, max_predict_steps=3)))
batches = Batches(rank=rank)  # each rank reads its own stream
spike_at = {"predict_seen": 0}


def loss_fn(eng, batch):
    loss = default_loss(eng, batch)
    # The second Predict verification on rank 1 sees a spike; rank 0 sees nothing odd.
    if rank == 1 and eng.phase is Phase.PREDICT and not torch.is_grad_enabled():
        spike_at["predict_seen"] += 1
        if spike_at["predict_seen"] == 2:
            return loss * 10
    return loss


record = []
for _ in range(steps):
    r = engine.train_step(batches.step(), loss_fn=loss_fn)
    record.append({"phase": r.phase, "loss": r.loss, "accepted": r.accepted, "rolled_back": r.rolled_back_steps,
                   "step": r.step, "scale": r.step_scale, "confidence": r.confidence})
digest = hashlib.sha256(b"".join(p.float().numpy().tobytes() for p in full_params(engine))).hexdigest()
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"record": record, "weights_sha256": digest, "global_steps": engine.global_steps,
               "statistics": engine.statistics()}, f)
dist.barrier()
print(f"RANK{rank} DONE", flush=True)
sys.stdout.flush()
os._exit(0)  # gloo teardown can abort after the work is done; the marker above is what counts
