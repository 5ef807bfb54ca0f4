"""The planner's pinned host memory: torch's power-of-two rounding of DeepSpeed's offload blocks
and the hybrid's velocity, checked against the pinned peaks the profiler recorded on GPUs, and
what it decides for 7B on the lent machine's 125 GiB."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from ds_hybrid import pinned
from ds_hybrid.arguments import resolve_config
from ds_hybrid.memory import planner as pl

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB, GB = 2 ** 20, 2 ** 30, 10 ** 9


def test_a_pinned_block_is_rounded_to_a_power_of_two_unless_above_the_limit():
    b = pinned.pinned_block_bytes
    assert [b(0), b(1), b(4096), b(4097)] == [0, 1, 4096, 8192]
    assert b(3 * GiB) == 4 * GiB                       # every block rounded (torch 2.11)
    assert b(3 * GiB, 64) == 3 * GiB                   # above 64 MiB: its own size (--pinned-round-mb 64)
    assert b(60 * MiB, 64) == 64 * MiB and b(65 * MiB, 64) == 65 * MiB


def _recorded_pinned_peak(run: str) -> float:
    """The pinned peak (MiB, torch's host allocator) the H200 recorded for a run of llama-1b on
    1b-16gb at one micro-batch a step (``ds-hybrid memory-bench --grad-accum 1``)."""
    data = json.loads((ROOT / "docs/results/offload-gpu-1b-grad-2026-11-27-h200.json").read_text())
    assert data["preset"] == "1b-16gb" and data["grad_accum"] == 1
    (r,) = [r for r in data["runs"] if r["run"] == run]
    return max(p["pinned_host_peak_mb"] for p in r["per_phase"].values())


# A small Llama in 4 layer groups, recorded pinning call by call on DeepSpeed's CPU accelerator.
TINY = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            vocab_size=1000, max_position_embeddings=128)


def _layout_config(stage: int, offload_param: bool, gas: int) -> dict:
    cfg, _ = resolve_config("7b-24gb" if stage == 3 else "7b-24gb-z2")
    cfg["gradient_accumulation_steps"], cfg["train_micro_batch_size_per_gpu"] = gas, 1
    if stage == 3 and not offload_param:
        cfg["zero_optimization"].pop("offload_param")
    cfg["hybrid_predict"]["enabled"] = False
    return cfg


def record_pins(stage: int, offload_param: bool, gas: int) -> list[int]:
    """Every block DeepSpeed asks its accelerator to pin while it builds the engine (under
    ``zero.Init`` on ZeRO 3, as ``ds-hybrid train`` does) and trains 2 steps: its bytes. Run in a
    process of its own (``zero.Init`` through transformers is process-wide state)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_hybrid
    from ds_hybrid.models import layer_groups
    acc, sizes = get_accelerator(), []
    pin = acc.pin_memory

    def recorded(t, *args, **kw):
        sizes.append(t.numel() * t.element_size())
        return pin(t, *args, **kw)

    acc.pin_memory = recorded
    cfg = _layout_config(stage, offload_param, gas)
    keep = None
    if stage == 3:
        from transformers.integrations import HfDeepSpeedConfig
        keep = HfDeepSpeedConfig(cfg)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    engine, *_ = ds_hybrid.initialize(model=model, model_parameters=layer_groups(model, 4), config=cfg)
    ids = torch.randint(0, 1000, (1, 16))
    for _ in range(2):
        engine.train_step([{"input_ids": ids, "labels": ids}] * gas)
    del keep
    return sizes


@pytest.mark.parametrize("stage, offload_param, gas", [(2, False, 1), (2, False, 2), (3, False, 1), (3, True, 1)])
def test_the_counted_pinned_blocks_are_the_blocks_deepspeed_pins(stage, offload_param, gas):
    """``planner.deepspeed_pinned_blocks`` is the list of blocks DeepSpeed pins, block for block,
    recorded on its CPU accelerator: ZeRO 2 (with and without accumulation), ZeRO 3 with the
    optimizer offloaded and with the parameters too."""
    import subprocess
    import sys

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_hybrid.memory.counts import shape_of
    from ds_hybrid.models import layer_groups
    code = (f"import json, test_planner_pinned as t; "
            f"print('PINS', json.dumps(t.record_pins({stage}, {offload_param}, {gas})))")
    # (a world of its own: not the port or rank an earlier test in this process set)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": f"{ROOT}:{Path(__file__).parent}"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("PINS ")]
    assert out.returncode == 0 and lines, out.stdout[-2000:] + out.stderr[-3000:]
    recorded = sorted(json.loads(lines[0][5:]))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    groups = tuple(tuple(p.numel() for p in g["params"]) for g in layer_groups(model, 4))
    shape = shape_of(model, "tiny", group_tensors=groups)
    preset = pl.preset_spec(_layout_config(stage, offload_param, gas), "layout")
    assert sorted(int(b) for b in pl.deepspeed_pinned_blocks(shape, preset)) == recorded


def test_the_counted_pinned_blocks_are_what_an_h200_pinned_for_llama_1b():
    """DeepSpeed's pinned blocks for llama-1b in 4 layer groups (fp32 masters, fp32 gradient and
    16-bit upload copy per group, the largest tensor's staging buffer), each rounded to a power
    of two, are the plain run's pinned peak; the hybrid's int8 velocity (data and scales per
    group, rounded the same way) is what its drift run pinned on top, to 0.01 MiB."""
    shape = pl.model_shape("llama-1b", vocab_size=256, layer_groups=4)
    cfg, _ = resolve_config("1b-16gb")
    cfg["gradient_accumulation_steps"] = 1
    preset = pl.preset_spec(cfg, "1b-16gb")
    assert preset.pin_memory and preset.velocity_bytes_per_value == pl.VELOCITY_BYTES["int8"]
    ds = pl.deepspeed_pinned_blocks(shape, preset)
    held = sum(pinned.pinned_block_bytes(int(x)) for x in ds) / MiB
    assert held == pytest.approx(_recorded_pinned_peak("full"), abs=0.01)          # 10287 MiB
    vel = pl.velocity_pinned_blocks(shape, preset)
    held_hybrid = held + sum(pinned.pinned_block_bytes(int(x)) for x in vel) / MiB
    assert held_hybrid == pytest.approx(_recorded_pinned_peak("drift-int8-device-next-behind"), abs=0.01)
    # The rounding alone, about a tenth of the blocks; limited above 64 MiB, only the small
    # blocks (the staging buffer, the embedding and head groups) round, 15 MiB in all
    assert pl.pinned_rounding(ds, 0) / MiB == pytest.approx(held - sum(ds) / MiB)
    assert pl.pinned_rounding(ds, 0) / sum(ds) == pytest.approx(0.109, abs=0.001)
    assert pl.pinned_rounding(ds, 64) < 16 * MiB


def _gradient_device(cfg: dict) -> dict:
    """``cfg`` with memory-bench's ``grad-device`` arm: gradient Predict steps on the device path."""
    cfg["hybrid_predict"]["predictor"] = {**cfg["hybrid_predict"].get("predictor", {}), "direction": "gradient"}
    cfg["hybrid_predict"]["memory"] = {**cfg["hybrid_predict"].get("memory", {}), "offload_predict": "device"}
    return cfg


def test_the_staging_chunk_is_the_quantisation_chunk():
    from ds_hybrid import quant, staging
    assert pinned.STAGE_CHUNK == quant.CHUNK
    assert staging.Stager().chunk == staging.QueuedDownloads().chunk == quant.CHUNK


def test_the_gradient_runs_staging_chunks_are_what_an_h200_pinned_on_top_of_plain_for_llama_1b():
    """The gradient device path's moments cross in bf16 beside bf16 weights: one Stager's two
    8 MiB buffers, what the H200's grad-device run pinned above the plain run's peak."""
    cfg, _ = resolve_config("1b-16gb")
    cfg["gradient_accumulation_steps"] = 1
    preset = pl.preset_spec(_gradient_device(cfg), "1b-16gb")
    staging = pl.staging_pinned_blocks(preset, "cuda")
    assert staging == [8.0 * MiB, 8.0 * MiB]
    extra = sum(pinned.pinned_block_bytes(int(b)) for b in staging) / MiB
    assert _recorded_pinned_peak("full") + extra == pytest.approx(_recorded_pinned_peak("grad-device"), abs=0.01)
    e = pl.estimate(pl.model_shape("llama-1b", vocab_size=256), preset, seq_len=1024, micro_batch=4)
    (item,) = [i for i in e.items if "staging chunks" in i.what]
    assert item.where == "cpu" and item.bytes == 16 * MiB and "staging chunks" in item.what
    # Nothing pinned on DeepSpeed's CPU accelerator, nor for a plain run, nor for the drift path
    # unless its commit brings the run's held copy down (fold_during_run: int8 values and fp32 scales)
    assert pl.staging_pinned_blocks(preset, "cpu") == []
    drift, _ = resolve_config("1b-16gb")
    drift = pl.preset_spec(drift, "1b-16gb")
    assert not drift.gradient and drift.velocity_bytes_per_value == pl.VELOCITY_BYTES["int8"]
    assert pl.staging_pinned_blocks(drift, "cuda") == []
    assert pl.staging_pinned_blocks(replace(drift, fold_during_run=True), "cuda") == [4.0 * MiB] * 2 + [16.0 * MiB] * 2
    assert pl.staging_pinned_blocks(replace(drift, fold_during_run=True), "cpu") == []
    assert pl.staging_pinned_blocks(replace(preset, hybrid_enabled=False), "cuda") == []
    # fp32 state beside bf16 weights: two buffers of each dtype
    assert sorted(pl.staging_pinned_blocks(replace(preset, gradient_state_dtype="fp32"), "cuda")) == \
        [8.0 * MiB] * 2 + [16.0 * MiB] * 2


def test_zero3s_parameter_offload_stages_the_gradient_shares_through_eight_buffers():
    """ZeRO 3 with ``offload_param``: the 16-bit shards are in host memory, so the moments cross
    nothing; each gradient share comes down through 8 buffers (bf16 on one rank, the fp32 state
    the shares are all-reduced in with several)."""
    cfg, _ = resolve_config("7b-24gb")
    preset = pl.preset_spec(_gradient_device(cfg), "7b-24gb")
    assert preset.stage == 3 and preset.offload_param == "cpu" and not preset.shards_on_gpu("cuda")
    assert pl.staging_pinned_blocks(preset, "cuda") == [8.0 * MiB] * 8
    assert pl.staging_pinned_blocks(preset, "cuda", W=2) == [16.0 * MiB] * 8


@pytest.mark.parametrize("run, hybrid", [("full", False), ("drift-int8-device-next-behind", True)])
def test_the_host_estimate_is_within_five_percent_of_the_h200s_peak_rss(run, hybrid):
    """The whole host figure (DeepSpeed's counted buffers, the rounding, the velocity and an
    assumed 3 GiB of process runtime) against the peak RSS the H200 run recorded: 1.04-1.05x."""
    data = json.loads((ROOT / "docs/results/offload-gpu-1b-grad-2026-11-27-h200.json").read_text())
    (r,) = [r for r in data["runs"] if r["run"] == run]
    cfg, _ = resolve_config("1b-16gb")
    cfg["gradient_accumulation_steps"] = 1
    cfg["hybrid_predict"]["enabled"] = hybrid
    e = pl.estimate(pl.model_shape("llama-1b", vocab_size=256), pl.preset_spec(cfg, "1b-16gb"), seq_len=1024,
                    micro_batch=4, pinned_round_mb=0)
    assert 1.0 < e.cpu_bytes / MiB / r["process_peak_rss_mb"] < 1.05


def test_zero3s_counted_pinned_blocks_are_what_an_h200_pinned_for_llama_1b():
    """The 7b-24gb layout (ZeRO 3, optimizer and parameters offloaded) on llama-1b: the gradient
    partitions, each sub-group's fp32 gradient, each group's flat 16-bit weights and every
    tensor's 16-bit partition from zero.Init, each rounded, are the H200's pinned peak."""
    data = json.loads((ROOT / "docs/results/offload-gpu-1b-grad-z3-2026-11-27-h200.json").read_text())
    assert data["preset"] == "7b-24gb" and data["grad_accum"] == 1
    (r,) = [r for r in data["runs"] if r["run"] == "full"]
    peak = max(p["pinned_host_peak_mb"] for p in r["per_phase"].values())
    cfg, _ = resolve_config("7b-24gb")
    cfg["gradient_accumulation_steps"] = 1
    blocks = pl.deepspeed_pinned_blocks(pl.model_shape("llama-1b", vocab_size=256), pl.preset_spec(cfg, "7b-24gb"))
    assert sum(pinned.pinned_block_bytes(int(b)) for b in blocks) / MiB == pytest.approx(peak, abs=0.01)   # 10711


def test_the_estimate_counts_the_rounding_and_the_accumulation_buffers():
    """Under ZeRO 2 with offload_optimizer: cpu on a GPU machine: the pinned rounding item (with
    the staging buffer) where pin_memory is on, none where it is off or on the CPU accelerator
    (nothing is pinned there); the 16-bit accumulation buffers with accumulation."""
    shape = pl.model_shape("llama-7b", vocab_size=256)
    cfg, _ = resolve_config("7b-24gb-z2")
    preset = pl.preset_spec(cfg, "7b-24gb-z2")
    assert preset.pin_memory and preset.gradient_accumulation == 1

    def cpu_items(p, accelerator="cuda", round_mb=0):
        e = pl.estimate(shape, p, seq_len=2048, accelerator=accelerator, pinned_round_mb=round_mb)
        return {i.what.split(" (")[0]: i.bytes for i in e.items if i.where == "cpu"}, e.cpu_bytes

    rounded, total0 = cpu_items(preset)
    limited, total64 = cpu_items(preset, round_mb=64)
    key = "pinned-memory rounding of DeepSpeed's offload blocks"
    # 4 layer groups: two bands of 3.24B values, whose fp32 blocks (12.9 GB) round to 16 GiB
    assert rounded[key] / GiB == pytest.approx(19.7, abs=0.1)
    assert limited[key] < 0.1 * GiB and total0 - total64 > 20 * GiB
    pageable, _ = cpu_items(replace(preset, pin_memory=False))
    assert not [k for k in pageable if k.startswith(("pinned-memory rounding", "the largest tensor"))]
    on_cpu, _ = cpu_items(preset, accelerator="cpu")
    assert not [k for k in on_cpu if k.startswith(("pinned-memory rounding", "the largest tensor"))]
    assert not [k for k in rounded if "accumulation buffer" in k]
    many, _ = cpu_items(replace(preset, gradient_accumulation=16))
    assert [v for k, v in many.items() if "accumulation buffer" in k] == [2 * shape.params]


def test_seven_b_on_the_lent_machine_fits_only_unpinned_or_with_limited_rounding():
    """7b-24gb-z2 (one micro-batch of 2 x 2048 a step) on a 24 GB GPU and a 125 GiB host: it fits
    where torch pins big blocks at their own size; where torch rounds every pinned block (2.11,
    the lent machine's) it fits only with DeepSpeed's pinning off; with 16 micro-batches a step
    the accumulation buffers put it over in every case."""
    shape = pl.model_shape("llama-7b", vocab_size=256)
    cfg, _ = resolve_config("7b-24gb-z2")
    z2 = pl.preset_spec(cfg, "7b-24gb-z2")

    def fits(p, round_mb):
        return pl.make_plan(shape, [p], 24 * GB, 125 * GiB, seq_len=2048, pinned_round_mb=round_mb).picked == p.name

    pageable = replace(z2, pin_memory=False)
    assert fits(z2, 64) and not fits(z2, 0) and fits(pageable, 0)
    # where the rounding puts it over, the plan says what fits instead
    (over,) = pl.make_plan(shape, [z2], 24 * GB, 125 * GiB, seq_len=2048, pinned_round_mb=0).estimates
    assert over.reasons[-1] == "117.7 GiB with zero_optimization.offload_optimizer.pin_memory: false (no pinned rounding)"
    many = replace(z2, micro_batch=1, gradient_accumulation=16)
    assert not any(fits(p, r) for p in (many, replace(many, pin_memory=False)) for r in (0, 64))


def test_the_plan_command_takes_the_rounding_and_the_layer_groups(capsys, tmp_path):
    base = ["--model", "llama-7b", "--vocab-size", "256", "--gpu-mem", "24GB", "--cpu-mem", "125GiB",
            "--seq-len", "2048", "--presets", "7b-24gb-z2"]
    assert pl.main(base + ["--pinned-round-mb", "0"]).picked is None
    plan = pl.main(base + ["--pinned-round-mb", "64", "--json", str(tmp_path / "plan.json")])
    assert plan.picked == "7b-24gb-z2" and plan.pinned_round_mb == 64
    assert json.loads((tmp_path / "plan.json").read_text())["assumptions"]["pinned_round_mb"] == 64
    assert pl.main(base).pinned_round_mb == (64 if pinned.can_limit_pinned_rounding() else 0)
    assert pl.model_shape("llama-1b", 256, layer_groups=1).group_numels == (970024960,)
    assert len(pl.model_shape("llama-1b", 256, layer_groups=6).group_numels) == 6
    for bad, flag in (("-1", "--pinned-round-mb"), ("lots", "--pinned-round-mb")):
        with pytest.raises(SystemExit, match=flag):
            pl.main(base + ["--pinned-round-mb", bad])
    with pytest.raises(SystemExit, match="--layer-groups"):
        pl.main(base + ["--layer-groups", "0"])


@pytest.mark.parametrize("pin", [True, False])
def test_the_engine_pins_its_host_velocity_only_as_deepspeed_pins(pin):
    """The hybrid follows offload_optimizer.pin_memory for its own host velocity (on a GPU machine
    it pins it beside GPU shards only where DeepSpeed pins its buffers)."""
    from engine_utils import EAGER, ds_config, make_engine
    cfg = ds_config(stage=2, offload_opt="cpu", hybrid=dict(EAGER, enabled=True))
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = pin
    engine = make_engine(cfg)
    assert engine._offload_pins_memory() is pin
    assert make_engine(ds_config(stage=2, hybrid=dict(EAGER, enabled=True)))._offload_pins_memory()


def test_ds_hybrid_train_says_when_pinned_rounding_is_what_puts_a_run_over(monkeypatch):
    """The pre-flight warning names the pinned rounding and the key that avoids it where the host
    fits without it (7B on the lent machine's 125 GiB with a torch that rounds every block)."""
    import argparse
    from ds_hybrid import train
    monkeypatch.setattr(pl, "host_memory_bytes", lambda *a, **k: 125 * GiB)
    cfg, _ = resolve_config("7b-24gb-z2")
    args = argparse.Namespace(model="llama-7b", seq_len=2048, local_rank=0, layer_groups=4)
    said = []
    plan = train.preflight_plan(cfg, args, False, 24 * GB, "cuda", said.append, pinned_round_mb=0)
    assert not plan["fits"] and "pin_memory: false" in said[-1] and "cannot limit" in said[-1]
    said.clear()
    assert train.preflight_plan(cfg, args, False, 24 * GB, "cuda", said.append, pinned_round_mb=64)["fits"]
    assert not said
