"""The bench's suites: model, preset, budget, data and the systems each compares.

Apart from ``bench`` so that ``bench_report`` (which names a result by its suite's default
model) and ``bench`` (which runs them) both read it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Suite:
    """A benchmark: model, preset, budget, data and the systems it compares."""

    name: str
    doc: str                              # what it answers, shown in the README section
    model: str                            # ds_hybrid.models name or config JSON
    config: str                           # ds_configs preset the runs start from
    steps: int                            # optimizer steps of the full budget
    seq_len: int
    seeds: tuple[int, ...]
    lr_multipliers: tuple[float, ...]     # baseline LR sweep around the preset's LR
    eval_every: int                       # resolution of the validation curves
    val_batches: int
    arms: tuple[str, ...] = ("baseline", "predict", "predict-skip", "groups", "default")
    budgets: tuple[float, ...] = (0.75, 0.875, 1.0, 1.25, 1.5)   # each arm runs those of its own it lists
    needs_gpu: bool = False
    overrides: dict = field(default_factory=dict)   # merged into the preset (nested dicts)
    data: str | None = None               # corpus: a path, "transformers-source", or None (stdlib)
    pretrain_steps: int = 0               # > 0: start every run from a model pre-trained this long on stdlib
    layer_groups: int = 4
    budgets_for_all: bool = False         # --budgets: every arm runs every budget (the default arm: 1 only)
    # How each run starts (ds_hybrid.bench_launch): "python", its own process on the cores the OS
    # gives it, or "deepspeed", the launcher with --bind_cores_to_rank, as a user starts it.
    launcher: str = "python"


SUITES: dict[str, Suite] = {
    "cpu-small": Suite(
        name="cpu-small",
        doc="GPT-2 0.84M parameters pre-trained from scratch on the Python standard library's source, 2 CPU "
            "cores, ZeRO 1 fp32",
        model="gpt2-tiny", config="tiny-cpu", steps=500, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8),
    "cpu-finetune": Suite(
        name="cpu-finetune",
        doc="the same model pre-trained for 1000 steps on the standard library's source, then trained on the "
            "`transformers` package's own Python source (a library's code base: what a user fine-tunes on), "
            "2 CPU cores, ZeRO 1 fp32",
        model="gpt2-tiny", config="tiny-cpu", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8, data="transformers-source",
        pretrain_steps=1000),
    "gpu-gpt2": Suite(
        name="gpu-gpt2",
        doc="GPT-2 124M (byte-level vocabulary) on one GPU, ZeRO 1 bf16",
        model="gpt2-124m", config="gpt2-124m", steps=2000, seq_len=512, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=100, val_batches=16, needs_gpu=True),
    "offload": Suite(
        name="offload",
        doc="optimizer in CPU memory (ZeRO-Offload): hybrid against ZeRO-Offload and DeepSpeed's ZenFlow",
        model="gpt2-tiny", config="tiny-cpu", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "predict", "predict-gradient", "zenflow"), launcher="deepspeed",
        # (2.0: the predict-gradient-quarter arm's longest run, and plain DeepSpeed's and ZenFlow's beside it)
        budgets=(0.75, 0.875, 1.0, 1.25, 1.5, 2.0),
        overrides={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    # The offload suite at grad_step_study's batch (64 sequences, AdamW's swept LR there 4e-3 at the
    # centre of this sweep), where a quarter of the batch at 15 Predict steps a real one reached plain
    # AdamW's final loss within a 3x schedule on every seed: the engine's own run of that setting,
    # timed beside plain ZeRO-Offload. Its Predict step costs a quarter's forward and backward (on
    # this CPU about 0.23 of a plain step; beside a GPU about 0.12 by the H200's timers).
    "offload-b64": Suite(
        name="offload-b64",
        doc="optimizer in CPU memory (ZeRO-Offload), 64 sequences a step: a quarter of the batch at 15 Predict "
            "steps a real one against ZeRO-Offload and DeepSpeed's ZenFlow",
        model="gpt2-tiny", config="tiny-cpu", steps=600, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "predict-gradient-quarter-15", "zenflow"), launcher="deepspeed",
        # (3.0 and 4.0: the quarter's long runs, 4.0 since one seed of three ended 0.85% above plain's final
        # loss at 3.0; plain DeepSpeed's and ZenFlow's longer schedules up to 1.5, where at this batch plain
        # reached its own final loss as soon as a 2x one would: grad_step_study, 571 and 569 steps)
        budgets=(1.0, 1.25, 1.5, 3.0, 4.0),
        overrides={"train_micro_batch_size_per_gpu": 64, "optimizer": {"params": {"lr": 4e-3}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}),
    # The offload-b64 arm's Predict section (a quarter of the batch, 15 after every real step) on the
    # 1b-16gb preset's layout (8 micro-batches of 4 sequences a step, activation checkpointing, bf16, ZeRO 2 +
    # ZeRO-Offload), with the CPU's model: benchmarks/offload-preset.json, shipped as the preset
    # 1b-16gb-gradient on 2026-12-05 and withdrawn the same day on this suite's result (it reached plain's
    # final loss on no seed). Run from the repository root (the config is a path).
    # Two things scaled to the CPU's budget, and only those: the LR (the preset's 3e-4 is a 1B model's;
    # plain's is swept around 3e-3 as offload-b64's around 4e-3 at twice the batch) and the hybrid's
    # warmup (the preset's 100 real steps of a 2000-step plain schedule, here 25 of 300, about the
    # offload-b64 arm's 50 of 600). Its quarter of the batch is 8 sequences, offload-b64's 16.
    "offload-preset": Suite(
        name="offload-preset",
        doc="the `1b-16gb` preset's layout (ZeRO 2 + ZeRO-Offload, bf16, activation checkpointing, 8 micro-batches "
            "of 4 sequences a step) with the `offload-b64` setting (each Predict step's gradient from 2 of them, 15 "
            "after every real step; `benchmarks/offload-preset.json`), its LR and warmup scaled to a 300-step "
            "budget, against plain ZeRO-Offload on the same layout",
        model="gpt2-tiny", config="benchmarks/offload-preset.json", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "preset-long"), launcher="deepspeed",
        budgets=(1.0, 1.25, 1.5, 3.0, 4.0),
        overrides={"optimizer": {"params": {"lr": 3e-3}}, "hybrid_predict": {"warmup_steps": 25}}),
    # The offload-preset suite's layout in fp32 (an AVX2 CPU runs a bf16 step at 7.65x an fp32 one:
    # docs/benchmarks.md, "bf16 on an AVX2 CPU"), each Predict step's gradient from half the batch (4
    # of the 8 micro-batches) and Adam's second moment updated by it as by a real step
    # (predictor.gradient_second_moment: updated): with the held one the preset's betas (0.9, 0.95)
    # stalled a 2x run near 2.9 (docs/offload.md, "At the 1b-16gb preset's batch"). The hybrid runs
    # 1.75x plain's budget (a one-seed 2x run crossed plain's final loss at two thirds of its steps;
    # its 1x run ended 6% above it) and 2.25x, and at 1.75x from a quarter of the batch; plain runs 1x,
    # 1.25x and 1.5x, whose longer schedules cross its full budget's final loss sooner than that budget
    # does. ZenFlow takes the 32 sequences in one micro-batch (it makes every micro-batch a step).
    # A Predict step's backward skips the recompute where its micro-batch fits (gradient_checkpointing:
    # auto), and here plain's does too: plain and the 1.75x hybrid also run without checkpointing, so
    # that the recompute's saving is told from the predicted steps' worth.
    "offload-preset-fp32": Suite(
        name="offload-preset-fp32",
        doc="the `offload-preset` suite's layout (ZeRO 2 + ZeRO-Offload, activation checkpointing, 8 micro-batches "
            "of 4 sequences a step) in fp32, each Predict step's gradient from half the batch (4 of the micro-batches, "
            "15 after every real step) with Adam's second moment updated by it "
            "(`predictor.gradient_second_moment: updated`), against plain ZeRO-Offload on the same layout, the "
            "same without activation checkpointing (as the hybrid, too) and DeepSpeed's ZenFlow",
        model="gpt2-tiny", config="benchmarks/offload-preset.json", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "preset-1.75x", "preset-2.25x", "preset-1.75x-quarter", "zenflow", "baseline-no-recompute",
              "preset-1.75x-no-recompute"),
        launcher="deepspeed",
        budgets=(1.0, 1.25, 1.5, 1.75, 2.25),
        overrides={"bf16": {"enabled": False}, "optimizer": {"params": {"lr": 3e-3}},
                   "hybrid_predict": {"warmup_steps": 25,
                                      "predictor": {"gradient_batch_fraction": 0.5,
                                                    "gradient_second_moment": "updated"}}}),
    # ZeRO-Infinity's layout on the host: ZeRO 3 with the optimizer and the 16-bit parameters in CPU
    # memory (the 7b-24gb preset's), where the gradient Predict step lays each parameter's gradient
    # on this rank's share as the backward produces it. No ZenFlow arm: DeepSpeed 0.19.8's ZenFlow
    # on this layout stops at the first forward (IndexError in the embedding; `--arms zenflow` shows it),
    # and its ZeRO 3 path allocates on device 'cuda' by name (engine_stage3.update_selected_channels).
    "offload-z3": Suite(
        name="offload-z3",
        doc="ZeRO 3 with the optimizer and the parameters in CPU memory (ZeRO-Offload + offload_param, the "
            "7B preset's layout): hybrid against plain ZeRO 3 offload",
        model="gpt2-tiny", config="tiny-cpu", steps=300, seq_len=128, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "predict", "predict-gradient"), launcher="deepspeed",
        overrides={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "cpu"}}}),
    # Where ZeRO-Offload users are: the CPU Adam step and the PCIe copies of a model far bigger
    # than its batch dominate the step, so a predicted step that stays on the GPU (memory.offload_predict
    # "auto" takes the device path beside a GPU: drift with no backward, or a gradient step with its
    # own forward and backward) saves most of one.
    "offload-gpu": Suite(
        name="offload-gpu",
        doc="GPT-2 124M (byte-level vocabulary) on one GPU with the optimizer in pinned CPU memory (ZeRO 2 "
            "+ ZeRO-Offload, bf16), 8 sequences of 256 bytes a step: hybrid against ZeRO-Offload and "
            "DeepSpeed's ZenFlow",
        model="gpt2-124m", config="gpt2-124m", steps=200, seq_len=256, seeds=(1, 2, 3),
        lr_multipliers=(0.5, 1.0, 2.0), eval_every=25, val_batches=8,
        arms=("baseline", "predict", "predict-gradient", "predict-gradient-quarter-15", "zenflow-overlap"),
        needs_gpu=True,
        launcher="deepspeed",
        # (3.0: the quarter at 1 : 15's longest run; plain DeepSpeed and ZenFlow run up to 2.0 beside it;
        #  ZenFlow as its tutorial recommends it beside a GPU, its CPU step overlapped with the next steps)
        budgets=(0.75, 0.875, 1.0, 1.25, 1.5, 2.0, 3.0),
        overrides={"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                         "overlap_comm": True, "contiguous_gradients": True}}),
}

# The offload-preset-fp32 suite in the preset's own precision (bf16), on a CPU whose kernels run it
# (AVX-512 with BF16: torch.backends.cpu.get_cpu_capability() "AVX512"; on an AVX2 one a bf16 step
# costs several fp32 ones and the suite is out of a sitting's reach). Its arms are that suite's that
# reached plain's final loss there, and plain beside each: the half-batch hybrid at 1.75x plain's
# budget, with and without activation checkpointing.
_FP32 = SUITES["offload-preset-fp32"]
SUITES["offload-preset-bf16"] = replace(
    _FP32, name="offload-preset-bf16",
    doc="the `offload-preset-fp32` suite in the `1b-16gb` preset's own precision, bf16 (ZeRO 2 + ZeRO-Offload, "
        "activation checkpointing, 8 micro-batches of 4 sequences a step; each Predict step's gradient from half "
        "the batch, 15 after every real step, Adam's second moment updated by it), against plain ZeRO-Offload on "
        "the same layout and both without activation checkpointing",
    arms=("baseline", "preset-1.75x", "baseline-no-recompute", "preset-1.75x-no-recompute"),
    budgets=(1.0, 1.25, 1.5, 1.75),
    overrides={k: v for k, v in _FP32.overrides.items() if k != "bf16"})
