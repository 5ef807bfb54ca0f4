"""One rank of the shared-memory test: with every rank on this host (``LOCAL_SIZE`` set, as
DeepSpeed's launcher does), DeepSpeed's CPU allreduce makes a segment in /dev/shm per rank.
After ``ds_hybrid.initialize`` this rank's segment must be unlinked, and DeepSpeed's shared-memory
allreduce, which reads it through the mapping, must still add up every rank's values."""
import argparse
import json
import os
import sys

import torch

from engine_utils import ds_config, make_engine

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

engine = make_engine(ds_config(stage=2))
import deepspeed.comm as dist  # noqa: E402  (after initialize, which sets up DeepSpeed's communicator)

rank, world = dist.get_rank(), dist.get_world_size()
dist.barrier()                  # every rank past its unlink
prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_"
left = sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))
x = torch.full((1 << 16,), float(rank + 1))
dist.inference_all_reduce(x)    # the shared-memory path (torch.ops.deepspeed.inference_all_reduce_)
dist.barrier()
report = {"left": left, "shm_op": getattr(dist.comm.cdb, "shm_comm_op", None) is not None,
          "sum": sorted(set(x.tolist()))}
json.dump(report, open(os.path.join(args.out, f"rank{rank}.json"), "w"))
print(f"RANK{rank} DONE", flush=True)
sys.stdout.flush()
