"""One rank of a multi-rank test: trains, then writes what it saw to ``<out>/rank{r}.json``.

Started by tests/spawn.py as N processes with RANK / WORLD_SIZE / MASTER_PORT set.
Each rank reads its own shard of the training stream (``ds_hybrid.data.train_batches``
with its rank). With ``--faults`` one rank at a time sees something wrong, and the
all-reduced decisions must act on every rank:

* step 2: the last rank's loss is NaN                -> every rank skips the update
* step 3: rank 0's loss is finite, its gradient NaN  -> every rank skips the update
* rank 1's second Predict verification: loss x 10    -> every rank rolls back
* ``--direction gradient``: rank 0's first gradient Predict step has a NaN loss
                                                     -> that Predict step moves nothing on any rank

With ``--save-dir`` the ranks save a checkpoint tagged ``final`` at the end.
"""
import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from ds_hybrid import Phase
from ds_hybrid.data import train_batches
from ds_hybrid.engine import default_loss
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from engine_utils import (NVME_AIO, EAGER, MICRO, SEQ, SWAPPED_LLAMA, ds_config, full_params, make_engine,
                          swap_params)

NAN_LOSS_STEP = 2   # 1-based step numbers (global_steps after the step)
NAN_GRAD_STEP = 3

parser = argparse.ArgumentParser()
parser.add_argument("--stage", type=int, required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--gas", type=int, default=1)
parser.add_argument("--faults", action="store_true")
parser.add_argument("--save-dir", default=None)
parser.add_argument("--out", required=True)
parser.add_argument("--predictor", default="adam_direction")
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--group-predict", action="store_true",
                    help="layer groups with layer-group Predict (planner with min_gain 0); with --faults rank 1's "
                         "second check of a predicted update sees its loss x 10")
parser.add_argument("--judge-harm", action="store_true",
                    help="whole-model runs checked by the next step, whose predicted updates also add noise to "
                         "this rank's masters (kept by a lenient band): the delayed judgement must stop Predict "
                         "on every rank at the same step")
parser.add_argument("--offload-predict", choices=["host", "device"], default=None,
                    help="offload_optimizer: cpu with drift runs checked by the next step, on this path "
                         "(memory.offload_predict); with --faults rank 1's second check of a run sees its loss x 10")
parser.add_argument("--fold-source", default="snapshot", choices=["snapshot", "optimizer_state", "weights16", "auto"],
                    help="with --offload-predict: memory.fold_source")
parser.add_argument("--fold-overlap", action="store_true",
                    help="with --offload-predict: memory.fold_overlap true (the fold behind the next real step)")
parser.add_argument("--fold-during-run", default="auto", choices=["auto", "true", "false"],
                    help="with --fold-overlap: memory.fold_during_run")
parser.add_argument("--fold-in-step", default="auto", choices=["auto", "true", "false"],
                    help="with --offload-predict: memory.fold_in_step (the fold and commit inside the CPU Adam step)")
parser.add_argument("--direction", default="drift", choices=["drift", "gradient"],
                    help="with --offload-predict: predictor.direction")
parser.add_argument("--cpu-step-behind", action="store_true",
                    help="with --direction gradient --offload-predict device: memory.cpu_step_behind")
parser.add_argument("--gradient-batch-fraction", type=float, default=1.0,
                    help="with --direction gradient: predictor.gradient_batch_fraction")
parser.add_argument("--checkpointing", default=None, choices=["auto", "true", "false"],
                    help="with --direction gradient: the model under activation checkpointing, and "
                         "predictor.gradient_checkpointing")
parser.add_argument("--no-room-rank", type=int, default=None,
                    help="with --checkpointing auto: this rank finds no room for the blocks' activations")
parser.add_argument("--gradient-second-moment", default="held", choices=["held", "updated"],
                    help="with --direction gradient: predictor.gradient_second_moment")
parser.add_argument("--gradient-state-dtype", default="auto",
                    help="with --direction gradient --offload-predict device: memory.gradient_state_dtype")
parser.add_argument("--offload-param", action="store_true",
                    help="with --stage 3 --offload-predict: offload_param: cpu too (the 16-bit partitions in host memory)")
parser.add_argument("--nvme", default=None,
                    help="with --offload-predict: offload_optimizer: nvme swapping into this folder (ZeRO 3)")
parser.add_argument("--params-on", choices=["cpu", "nvme"], default=None,
                    help="with --nvme: SWAPPED_LLAMA (its MLP twice as wide: each rank's share of a matrix above "
                         "DeepSpeed's smallest swappable tensor) in bf16, offload_param on cpu or on nvme "
                         "(swap_params)")
parser.add_argument("--tiny", action="store_true",
                    help="gpt2-tiny in sub-groups of 600k values (on 2 ranks each rank's partition is one, above "
                         "DeepSpeed's smallest swappable tensor, so --nvme swaps it)")
parser.add_argument("--copy-lp", action="store_true",
                    help="propagate by DeepSpeed's copy even where the update writes the 16-bit shards")
args = parser.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
hybrid = dict(EAGER, min_predict_steps=3, max_predict_steps=3)
if args.predictor == "rssm":
    # Decide early and often, so a short run exercises training, exploration and the bandit.
    hybrid.update(predictor={"type": "rssm"}, min_predict_steps=1,
                  dynamics={"min_observations": 4, "train_every": 2, "explore_every": 1, "window": 4})
if args.group_predict:
    hybrid = {"warmup_steps": 3, "full_steps": 6, "confidence_threshold": 0.0, "min_predict_steps": 2,
              "max_predict_steps": 2, "verify_every": 1, "correction_steps": 1, "check": "next_step",
              "predictor": {"direction": "drift", "drift_beta": 0.8},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0},
              "group_predict": {"enabled": True, "refresh_every": 3, "min_gain": 0.0}}
if args.judge_harm:
    from test_judgement import HARM
    hybrid = HARM
offload = {}
if args.offload_predict:
    hybrid = {"warmup_steps": 3, "full_steps": 2, "confidence_threshold": 0.0, "min_predict_steps": 2,
              "max_predict_steps": 2, "correction_steps": 0, "check": "next_step",
              "predictor": {"direction": args.direction} if args.direction != "gradient" else
              {"direction": "gradient", "gradient_batch_fraction": args.gradient_batch_fraction,
               "gradient_second_moment": args.gradient_second_moment,
               "gradient_checkpointing": {None: "auto", "auto": "auto", "true": True,
                                          "false": False}[args.checkpointing]},
              "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0},
              "memory": {"offload_predict": args.offload_predict, "fold_source": args.fold_source,
                         "fold_overlap": args.fold_overlap or "auto",
                         "fold_during_run": {"auto": "auto", "true": True, "false": False}[args.fold_during_run],
                         "fold_in_step": {"auto": "auto", "true": True, "false": False}[args.fold_in_step],
                         "gradient_state_dtype": args.gradient_state_dtype,
                         **({"cpu_step_behind": True} if args.cpu_step_behind else {})}}
    offload = {"offload_opt": "cpu", **({"offload_param": "cpu"} if args.offload_param else {})}
    if args.nvme:
        offload.update(offload_opt="nvme", nvme_path=args.nvme, **NVME_AIO)
model = dict(model="gpt2-tiny" if args.tiny else "gpt2-test")
if args.params_on:
    offload["offload_param"] = args.params_on
    model = dict(SWAPPED_LLAMA, intermediate_size=3072)
cfg = ds_config(stage=args.stage, gas=args.gas, bf16=args.bf16 or bool(args.params_on), hybrid=hybrid, **offload)
if args.params_on == "nvme":
    swap_params(cfg)
if args.params_on:   # (the same sub-groups either way: the int8 velocity's blocks and noise follow them)
    cfg["zero_optimization"]["sub_group_size"] = 1_000_000
if args.tiny:
    cfg["zero_optimization"]["sub_group_size"] = 600_000
if args.stage == 3 and args.direction == "gradient":
    # every parameter released after its forward and gathered again for its backward (the test
    # model's are all below DeepSpeed's default persistence threshold)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
engine = make_engine(cfg, groups=4 if args.group_predict else 0, **model)
if args.checkpointing:
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
if args.no_room_rank == rank:
    import ds_hybrid.grad_recompute as gr
    gr.limit_bytes = lambda device, local_ranks: 0.0
lp_written = {"propagations": 0}   # propagations that found the 16-bit shards written by the update
if args.copy_lp:
    engine._masters._lp = lambda i: None
_propagate = engine._masters.propagate


def counted_propagate():
    lp_written["propagations"] += engine._masters.lp_current
    _propagate()


engine._masters.propagate = counted_propagate
if args.judge_harm:
    from ds_hybrid import zero_access as za
    _apply, _noise = za.apply_velocity_update, torch.Generator().manual_seed(100 + rank)

    def noisy_update(access, velocity, scales, **kw):
        _apply(access, velocity, scales, **kw)
        for part in access.partitions():
            part.master.add_(torch.randn(part.master.shape, generator=_noise, dtype=part.master.dtype) * 0.05)
    za.apply_velocity_update = noisy_update
corpus = torch.randint(0, 48, (8192,), generator=torch.Generator().manual_seed(1)).to(torch.uint8)
stream = train_batches(corpus, SEQ, MICRO, seed=7, rank=rank, world_size=world)
predict_verifications = {"seen": 0}
predict_gradients = {"seen": 0}


def nan_gradient_loss(eng, batch, poison: bool):
    """A finite loss whose gradient is NaN when ``poison``: d/dz sqrt(z + eps) at z = 0 is
    inf for eps = 0, times 0. Every rank builds the same graph (ZeRO 3 gathers parameters
    in backward in graph order, so ranks must not differ in it); only the value of eps differs."""
    out = eng(**batch)
    z = out.logits.float().sum()
    eps = 0.0 if poison else 1.0
    return out.loss + 0.0 * torch.sqrt(z - z.detach() + eps)


def loss_fn(eng, batch):
    step = eng.global_steps + 1  # the step being computed
    real = torch.is_grad_enabled()
    if args.faults and real and step == NAN_LOSS_STEP and rank == world - 1:
        return default_loss(eng, batch) * float("nan")
    if args.faults and real and step == NAN_GRAD_STEP:
        return nan_gradient_loss(eng, batch, poison=rank == 0)
    loss = default_loss(eng, batch)
    if args.group_predict:
        if args.faults and rank == 1 and real and eng._check_groups is not None and not eng._check_run:
            predict_verifications["seen"] += 1
            if predict_verifications["seen"] == 2:
                return loss * 10
        return loss
    if args.offload_predict:
        if args.faults and args.direction == "gradient" and eng.phase is Phase.PREDICT and rank == 0:
            predict_gradients["seen"] += 1   # (a gradient Predict step's own forward)
            if predict_gradients["seen"] == 1:
                return loss * float("nan")
        if args.faults and rank == 1 and real and eng._check_groups is not None and eng._check_run:
            predict_verifications["seen"] += 1
            if predict_verifications["seen"] == 2:
                return loss * 10
        return loss
    if args.faults and rank == 1 and eng.phase is Phase.PREDICT and not real:
        predict_verifications["seen"] += 1
        if predict_verifications["seen"] == 2:
            return loss * 10
    return loss


def batch_digest(batch: dict) -> str:
    return hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16]


def json_state(sd: dict) -> dict:
    sd = {k: v for k, v in sd.items() if k != "difficulty"}
    if args.predictor == "rssm":
        sd.pop("predictor")
    return sd


record = []
for _ in range(args.steps):
    micro = [next(stream) for _ in range(args.gas)]
    r = engine.train_step(micro, loss_fn=loss_fn)
    record.append({"phase": r.phase, "loss": r.loss, "accepted": r.accepted, "rolled_back": r.rolled_back_steps,
                   "predicted_groups": r.predicted_groups, "checked": r.checked,
                   "skipped": r.skipped, "step": r.step, "lr": r.lr, "batches": [batch_digest(b) for b in micro]})
bad_saves = []
if args.save_dir:
    # Bad directories fail on every rank before any rank writes or waits (no hang), as in DeepSpeed.
    for bad in (None, ""):
        try:
            engine.save_checkpoint(bad)
        except ValueError as err:
            bad_saves.append(str(err))
    engine.save_checkpoint(args.save_dir, "final")
digest = hashlib.sha256(b"".join(p.float().numpy().tobytes() for p in full_params(engine))).hexdigest()
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"record": record, "weights_sha256": digest, "global_steps": engine.global_steps,
               "micro_steps": engine.micro_steps, "deepspeed_skipped_steps": engine.skipped_steps,
               "lp_written_propagations": lp_written["propagations"], "bad_saves": bad_saves,
               "swapped_sub_groups": [bool(engine.optimizer._swappable_optimizer_subgroup(i))
                                      for i in range(len(engine.optimizer.fp16_partitioned_groups_flat_numel))]
               if getattr(engine.optimizer, "swap_optimizer", False) else [],
               "shards_swapped": [engine._masters.shard_swapped(i) for i in range(engine._masters._count())],
               "shards_on_drive": sum(getattr(p.ds_tensor, "final_location", None) == OffloadDeviceEnum.nvme
                                      for p in engine.module.parameters() if hasattr(p, "ds_tensor")),
               "statistics": {k: v for k, v in engine.statistics().items() if k != "predictor_details"},
               # (JSON: the RSSM's state and the difficulty counts hold tensors; compared elsewhere)
               "hybrid_state": json_state(engine.hybrid_state_dict())}, f)
dist.barrier()
print(f"RANK{rank} DONE", flush=True)
sys.stdout.flush()
os._exit(0)  # gloo teardown can abort after the work is done; the marker above is what counts
