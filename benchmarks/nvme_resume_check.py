"""Does plain DeepSpeed resume ZeRO 3 with ``offload_optimizer: nvme`` from its own checkpoint?

Trains gpt2-tiny 5 steps with plain ``deepspeed.initialize`` (DeepSpeed's CPU accelerator or a
GPU), saves, loads the checkpoint into a fresh engine (other initial weights, its own swap
folder), then steps both 3 more times on the same batches. Once with ``offload_optimizer: cpu``
and once with ``nvme`` (sub-groups of 420k values: both above DeepSpeed's smallest swappable
tensor, so both are swapped). Prints and writes (``--json``) the losses side by side, whether the
loaded weights equal the saved ones and which Adam state keys the loaded optimizer holds.

    .venv/bin/python benchmarks/nvme_resume_check.py [--json out.json]

docs/deepspeed-parity.md cites its result (DeepSpeed 0.19.8: the NVMe run does not resume). The load is
in the same process, whose second engine numbers its parameters on from the first: DeepSpeed's
NVMe files, named by those ids, then load nothing, not even the masters. A fresh process loads the
masters but not the Adam state (tests/test_nvme_resume.py, which also checks ds_hybrid's mend).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29533")}.items():
        os.environ.setdefault(k, v)
    import torch
    from engine_utils import NVME_AIO, Batches, ds_config, full_params, make_engine
    root = tempfile.mkdtemp(prefix="nvme-resume-")

    def build(device: str, folder: str, seed: int):
        cfg = ds_config(stage=3, offload_opt=device, nvme_path=os.path.join(root, folder), **NVME_AIO)
        cfg["zero_optimization"]["sub_group_size"] = 420_000
        return make_engine(cfg, model="gpt2-tiny", plain=True, seed=seed)

    def step(engine, batch) -> float:
        loss = engine(**batch[0]).loss
        engine.backward(loss)
        engine.step()
        return float(loss)

    out: dict = {}
    for device in ("cpu", "nvme"):
        saved = build(device, f"saved-{device}", 0)
        batches = Batches(seed=3)
        for _ in range(5):
            step(saved, batches.step())
        saved.save_checkpoint(os.path.join(root, f"ckpt-{device}"), tag="t")
        at_save = batches.gen.get_state()
        loaded = build(device, f"loaded-{device}", 1)
        loaded.load_checkpoint(os.path.join(root, f"ckpt-{device}"), tag="t")
        row = {"weights_equal_after_load": all(torch.equal(a, b) for a, b in zip(full_params(saved),
                                                                                full_params(loaded))),
               "adam_state_keys_after_load": sorted({k for st in loaded.optimizer.optimizer.state.values()
                                                     for k in st}),
               "swapped_sub_groups": [bool(saved.optimizer._swappable_optimizer_subgroup(i))
                                      for i in range(len(saved.optimizer.fp16_partitioned_groups_flat_numel))]
               if device == "nvme" else [],
               "losses_saved_run": [], "losses_loaded_run": []}
        again = Batches(seed=3)
        again.gen.set_state(at_save)
        for _ in range(3):
            row["losses_saved_run"].append(step(saved, batches.step()))
            row["losses_loaded_run"].append(step(loaded, again.step()))
        out[device] = row
        print(f"{device}: weights equal after load {row['weights_equal_after_load']}, Adam state keys "
              f"{row['adam_state_keys_after_load']}, losses saved run {row['losses_saved_run']}, "
              f"loaded run {row['losses_loaded_run']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
