"""Small engines and batches for the engine tests (2-layer, 32-wide GPT-2)."""
from __future__ import annotations

import copy
import logging

import deepspeed
import torch

import ds_hybrid
from ds_hybrid.models import build_model

deepspeed.utils.logger.setLevel(logging.ERROR)

SEQ = 16
MICRO = 4


LR = 3e-3   # ds_config's peak learning rate (AdamW, WarmupLR to it over 10 steps)


def ds_config(stage: int = 2, bf16: bool = False, offload_opt: str | None = None, offload_param: str | None = None,
              gas: int = 1, hybrid: dict | None = None, nvme_path: str | None = None, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
    }
    zo = cfg["zero_optimization"]
    if offload_opt:
        zo["offload_optimizer"] = {"device": offload_opt, **({"nvme_path": nvme_path} if offload_opt == "nvme" else {})}
    if offload_param:
        zo["offload_param"] = {"device": offload_param, **({"nvme_path": nvme_path} if offload_param == "nvme" else {})}
    if hybrid is not None:
        cfg["hybrid_predict"] = hybrid
    cfg.update(extra)
    return cfg


def aio_available() -> bool:
    """DeepSpeed's NVMe op can be built here (libaio present): the NVMe tests skip cleanly otherwise."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        return AsyncIOBuilder().is_compatible(verbose=False)
    except Exception:
        return False


def count_swap_ins(engine) -> list[int]:
    """Count the optimizer sub-groups DeepSpeed's ZeRO 3 swaps in from NVMe: the returned
    one-item list goes up by one at each swap-in (the caller resets it)."""
    swapped = [0]
    swap_in = engine.optimizer._optimizer_states_and_gradient_swap_in

    def counted(*args, **kwargs):
        swapped[0] += 1
        return swap_in(*args, **kwargs)
    engine.optimizer._optimizer_states_and_gradient_swap_in = counted
    return swapped


# DeepSpeed's NVMe swap with small blocks (the tests' sub-groups are a few MiB)
NVME_AIO = {"aio": {"block_size": 262144, "queue_depth": 4, "single_submit": False, "overlap_events": True}}

# A Llama whose MLP matrices (384 x 1536, 1.1 MiB in bf16) are above the smallest tensor DeepSpeed's
# parameter swapper puts on NVMe (1 MiB), in about five sub-groups of 1M values: with offload_param:
# nvme and max_in_cpu 1.5M, the first sub-group's 16-bit partition stays in host memory and the
# others have none there, each holding partitions both on the drive and kept in memory (the smaller
# ones). DeepSpeed 0.19.8's NVMe prefetch assigns a parameter a second swap buffer at the second
# forward and fails where max_in_cpu splits the model so (and where GPT-2 ties its embedding to its
# head: Llama's are not tied); stage3_prefetch_bucket_size 0 turns that prefetch off.
SWAPPED_LLAMA = dict(model="llama-tiny", hidden_size=384, intermediate_size=1536, num_hidden_layers=2)


def swap_params(cfg: dict) -> dict:
    """``cfg`` (ZeRO 3, bf16, ``offload_param: nvme``) with SWAPPED_LLAMA's sub-groups, the
    parameter swapper's buffers sized for it and DeepSpeed's prefetch off."""
    zo = cfg["zero_optimization"]
    zo["sub_group_size"] = 1_000_000
    zo["stage3_prefetch_bucket_size"] = 0
    zo["offload_param"].update(max_in_cpu=1_500_000, buffer_size=600_000, buffer_count=6)
    return cfg


# Predict as soon as possible: short warmup, no confidence gate, a lenient band.
EAGER = {"warmup_steps": 3, "full_steps": 2, "min_predict_steps": 2, "max_predict_steps": 2,
         "confidence_threshold": 0.0, "correction_steps": 1, "verify_every": 1,
         "divergence": {"rel_tolerance": 0.5, "z_threshold": 10.0, "max_loss_ratio": 3.0}}


def make_engine(cfg: dict, seed: int = 0, plain: bool = False, groups: int = 0, model: str = "gpt2-test",
                **overrides):
    """An engine on a tiny model; ``groups``: that many layer groups (models.layer_groups)
    as the optimizer's param groups, else one. ``overrides``: the model config's own keys."""
    from ds_hybrid.models import layer_groups
    torch.manual_seed(seed)
    net = build_model(model, vocab_size=256, seq_len=SEQ, **overrides)
    init = deepspeed.initialize if plain else ds_hybrid.initialize
    params = layer_groups(net, groups) if groups else net.parameters()
    engine, *_ = init(model=net, model_parameters=params, config=copy.deepcopy(cfg))
    return engine


class Batches:
    """A deterministic stream of micro-batches from a low-entropy byte sequence."""

    def __init__(self, seed: int = 1, rank: int = 0, device: torch.device | str = "cpu"):
        self.device = device   # the engine's (a CUDA engine's batches must be on its GPU)
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank)
        base = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 48, (8192,), generator=base)

    def micro(self) -> dict:
        starts = torch.randint(0, self.data.numel() - SEQ, (MICRO,), generator=self.gen)
        x = torch.stack([self.data[s:s + SEQ] for s in starts])
        x = x.to(self.device)
        return {"input_ids": x, "labels": x.clone()}

    def step(self, gas: int = 1) -> list[dict]:
        return [self.micro() for _ in range(gas)]


def resumed_in_a_run(ref, batches: Batches, path, make) -> tuple:
    """Train ``ref`` into its first Predict run, take one step of it, save a checkpoint there and
    load it into ``make()`` (an engine with other initial weights). Returns that engine and a copy
    of ``batches`` that goes on where it does."""
    while ref.controller.phase.value != "predict":
        ref.train_step(batches.step())
    ref.train_step(batches.step())
    assert ref._device_predict.pending and ref.controller.phase.value == "predict"
    ref.save_checkpoint(str(path), tag="mid")
    resumed = make()
    resumed.load_checkpoint(str(path), tag="mid")
    again = copy.copy(batches)
    again.gen = torch.Generator()
    again.gen.set_state(batches.gen.get_state())
    return resumed, again


def step_together(a, b, batches_a: Batches, batches_b: Batches):
    """One ``train_step`` of each engine on its stream: the same phase, loss and weights after it."""
    ra, rb = a.train_step(batches_a.step()), b.train_step(batches_b.step())
    assert (ra.phase, ra.loss) == (rb.phase, rb.loss)
    for x, y in zip(full_params(a), full_params(b)):
        assert torch.equal(x, y)
    return ra


def full_params(engine) -> list[torch.Tensor]:
    """Copies of every model parameter as the forward pass sees it (gathered on ZeRO 3)."""
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().clone() for p in params]
    return [p.detach().clone() for p in params]


def same_velocity(a, b) -> bool:
    """The two engines' drift velocities hold the same values (and count the same updates)."""
    va, vb = a._velocity, b._velocity
    if va.updates != vb.updates or len(va.buffers) != len(vb.buffers):
        return False
    return all((x is None) == (y is None) and (x is None or (torch.equal(x.data, y.data) and (
        getattr(x, "scale", None) is None or torch.equal(x.scale, y.scale)))) for x, y in zip(va.buffers, vb.buffers))


def master_copies(engine) -> list[torch.Tensor]:
    return [p.master.detach().clone() for p in engine._masters.partitions()]


def committed(masters: list[torch.Tensor], group_indices, bufs: list, run: list[list[float]]) -> list[torch.Tensor]:
    """What a device-side run's commit makes of ``masters`` (flat, on the host): each partition
    takes every step's ``coef * v`` in order, ``v`` from ``bufs`` (its velocity, any device)."""
    out = []
    for m, gi, buf in zip(masters, group_indices, bufs):
        m = m.view(-1).clone()
        for coefs in run:
            m.add_(buf.load().cpu(), alpha=coefs[gi])
        out.append(m)
    return out


class OneShardAccess:
    """What DevicePredict reads of a MasterAccess, for one partition in param group 0: its 16-bit
    copy ``shard`` (a Predict step's target) and, for a commit, its fp32 ``master``."""

    swaps = False   # (in memory: no NVMe swap)

    def __init__(self, shard: torch.Tensor, master: torch.Tensor | None = None):
        from ds_hybrid.zero_access import MasterPartition
        self.shard = shard
        self.parts = [] if master is None else [MasterPartition(master, {}, {}, 0.0, 0)]

    def group_indices(self):
        return [0]

    def num_groups(self):
        return 1

    def device_shard(self, i):
        return self.shard

    def shard_swapped(self, i):
        return False   # (in memory: not on NVMe)

    def partitions(self):
        return self.parts


class BackwardCounter:
    """Counts autograd backward calls (every engine.backward ends in one)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch.autograd.backward

        def counting(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "backward", counting)


def steps_alike(ref, resumed, batches, seed: int, state, steps: int = 6) -> None:
    """``ref`` trains on ``batches``, ``resumed`` on a ``Batches(seed)`` from generator ``state`` (where
    ``batches`` stood at the save): every step the same phase, loss and check, and after it the same
    weights, masters and first moments, bit for bit."""
    again = Batches(seed=seed)
    again.gen.set_state(state)
    for _ in range(steps):
        r1, r2 = ref.train_step(batches.step()), resumed.train_step(again.step())
        assert (r1.phase, r1.loss, r1.checked) == (r2.phase, r2.loss, r2.checked)
        for got, want in ((full_params(resumed), full_params(ref)), (master_copies(resumed), master_copies(ref)),
                          (first_moments(resumed), first_moments(ref))):
            assert all(torch.equal(x, y) for x, y in zip(got, want))


def first_moments(engine) -> list[torch.Tensor]:
    return [p.state["exp_avg"].detach().clone() for p in engine._masters.partitions()]


def commit_and_check(engine, masters: list[torch.Tensor], run_m: list[torch.Tensor]) -> None:
    """Commits a device-side gradient run over bf16 weights and checks what it wrote: each master is
    its 16-bit weight plus the residual below bf16 of ``masters`` (copies from before the run), and
    the optimizer's first moment is ``run_m`` (the run's, flat, on the host)."""
    shards = [engine._gradient._shard(i).float().cpu() for i in range(len(masters))]
    engine._gradient.commit()
    for got, good, w in zip(master_copies(engine), masters, shards):
        assert torch.equal(got.view(-1), w + (good.view(-1) - good.view(-1).to(torch.bfloat16).float()))
    for got, want in zip(first_moments(engine), run_m):
        assert torch.equal(got.view(-1), want)
