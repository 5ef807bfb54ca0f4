"""Every ds_configs/ preset: parsed by DeepSpeed and by our section, batch identity, documented, as described."""
import json
import os
from pathlib import Path

import pytest
from deepspeed.runtime import config as ds_config_module
from deepspeed.runtime.config import DeepSpeedConfig

from ds_hybrid.config import parse_hybrid_config
from ds_hybrid.arguments import resolve_config

PRESET_DIR = Path(__file__).resolve().parent.parent / "ds_configs"
PRESETS = sorted(PRESET_DIR.glob("*.json"))
EXPECTED = {"tiny-cpu", "gpt2-124m", "1b-16gb", "7b-24gb", "7b-24gb-z2", "7b-24gb-nvme", "50b-24gb-nvme"}


class _FakeDist:
    """DeepSpeedConfig asks deepspeed.comm for the rank and world size; no process group is needed."""

    def __init__(self, world: int) -> None:
        self.world = world

    def get_rank(self) -> int:
        return 0

    def get_world_size(self, group=None) -> int:
        return self.world


def parse(cfg: dict, world: int, monkeypatch) -> DeepSpeedConfig:
    monkeypatch.setattr(ds_config_module, "dist", _FakeDist(world))
    return DeepSpeedConfig(json.loads(json.dumps(cfg)))  # DeepSpeed fills in the dict it is given


def test_the_presets_the_issue_asks_for_exist():
    assert EXPECTED <= {p.stem for p in PRESETS}


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
@pytest.mark.parametrize("world", [1, 8])
def test_preset_parses_and_keeps_the_batch_identity(path, world, monkeypatch):
    cfg = json.loads(path.read_text())
    hybrid = parse_hybrid_config(cfg)
    assert hybrid.enabled, f"{path.name}: a preset should run the phase cycle"
    ds = parse(cfg, world, monkeypatch)
    assert ds.world_size == world
    assert ds.train_batch_size == ds.train_micro_batch_size_per_gpu * ds.gradient_accumulation_steps * world
    if "train_batch_size" in cfg:  # a fixed global batch: DeepSpeed derives the rest
        assert ds.train_batch_size == cfg["train_batch_size"]
    else:
        assert ds.train_micro_batch_size_per_gpu == cfg["train_micro_batch_size_per_gpu"]
        assert ds.gradient_accumulation_steps == cfg.get("gradient_accumulation_steps", 1)


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_preset_is_documented_and_loadable_by_name(path):
    readme = (PRESET_DIR / "README.md").read_text()
    assert f"`{path.stem}`" in readme, f"ds_configs/README.md has no entry for {path.stem}"
    cfg, resolved = resolve_config(path.stem)
    assert resolved == path and cfg["hybrid_predict"]


def test_big_model_presets_are_what_their_names_say(monkeypatch):
    def zero(name):
        return parse(json.loads((PRESET_DIR / f"{name}.json").read_text()), 1, monkeypatch)

    one = zero("1b-16gb")
    assert one.zero_optimization_stage in (2, 3) and one.bfloat16_config.enabled
    assert one.zero_config.offload_optimizer.device == "cpu"
    assert one.zero_config.offload_param is None or one.zero_config.offload_param.device == "none"
    assert "activation_checkpointing" in json.loads((PRESET_DIR / "1b-16gb.json").read_text())

    seven = zero("7b-24gb")
    assert seven.zero_optimization_stage == 3 and seven.bfloat16_config.enabled
    assert seven.zero_config.offload_optimizer.device == "cpu" and seven.zero_config.offload_param.device == "cpu"

    # 7B on a 125 GiB host: ZeRO 2, bf16 weights on the GPU, optimizer in host memory (18 bytes a
    # parameter, counted, where 7b-24gb's parameter offload needs 20); the velocity's GPU copy only
    # during a Predict run
    z2 = zero("7b-24gb-z2")
    assert z2.zero_optimization_stage == 2 and z2.bfloat16_config.enabled
    assert z2.zero_config.offload_optimizer.device == "cpu"
    assert z2.zero_config.offload_param is None or z2.zero_config.offload_param.device == "none"
    assert parse_hybrid_config(json.loads((PRESET_DIR / "7b-24gb-z2.json").read_text())).memory.free_velocity_copy

    # 7B on a host with 64 GB: 7b-24gb with the optimizer on NVMe (ZeRO-Infinity), the 16-bit
    # weights in host memory (where a Predict step writes them), sub-groups of 100M elements
    nvme = zero("7b-24gb-nvme")
    assert nvme.zero_optimization_stage == 3 and nvme.bfloat16_config.enabled
    assert nvme.zero_config.offload_optimizer.device == "nvme" and nvme.zero_config.offload_param.device == "cpu"
    assert str(nvme.zero_config.offload_optimizer.nvme_path) == "/local_nvme"
    assert nvme.zero_config.sub_group_size == 100_000_000

    fifty = zero("50b-24gb-nvme")
    assert fifty.zero_optimization_stage == 3 and fifty.bfloat16_config.enabled
    assert fifty.zero_config.offload_optimizer.device == "nvme" and fifty.zero_config.offload_param.device == "nvme"
    # A placeholder mount, documented as such; nothing here needs it to exist.
    assert str(fifty.zero_config.offload_param.nvme_path) == "/local_nvme"
    assert str(fifty.zero_config.offload_optimizer.nvme_path) == "/local_nvme"
    assert "/local_nvme" in (PRESET_DIR / "README.md").read_text()
    # DeepSpeed's parameter swapper needs a buffer at least as large as the largest parameter
    # (the planner's 50B shape: a 32000 x 8192 embedding).
    assert fifty.zero_config.offload_param.buffer_size >= 32000 * 8192

    for name in ("1b-16gb", "7b-24gb", "7b-24gb-z2", "7b-24gb-nvme", "50b-24gb-nvme"):
        hybrid = parse_hybrid_config(json.loads((PRESET_DIR / f"{name}.json").read_text()))
        assert hybrid.snapshot_device == "cpu", f"{name}: the snapshot of a big model belongs in host memory"


def test_the_train7b_stage_config_trains_on_the_cpu(tmp_path):
    """benchmarks/gpu_run.sh's train7b config, as its own snippet writes it (7b-24gb-z2: one
    micro-batch of 2 sequences a step, Predict from step 4, checked by the next step; DeepSpeed's
    pinning as this torch can limit its rounding), with a small model: both arms run through
    ds-hybrid train, the hybrid takes Predict steps, and on the CPU there is no GPU copy to free."""
    import subprocess
    import sys

    from ds_hybrid import train
    from ds_hybrid.pinned import can_limit_pinned_rounding
    from spawn import write_corpus
    stage = (PRESET_DIR.parent / "benchmarks" / "gpu_run.sh").read_text().split("    train7b)", 1)[1].split(";;", 1)[0]
    snippet = stage.split('$PY -c "', 1)[1].split('"\n', 1)[0]
    assert "ds_configs/7b-24gb-z2.json" in snippet and "/tmp/7b-short.json" in snippet
    out = subprocess.run([sys.executable, "-c", snippet.replace("/tmp/7b-short.json", str(tmp_path / "7b-short.json"))],
                         cwd=PRESET_DIR.parent, capture_output=True, text=True, check=True).stdout
    cfg = json.loads((tmp_path / "7b-short.json").read_text())
    assert cfg["gradient_accumulation_steps"] == 1 and cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] is can_limit_pinned_rounding()
    assert f"pin_memory {can_limit_pinned_rounding()}" in out
    assert cfg["hybrid_predict"]["warmup_steps"] == 4 and cfg["hybrid_predict"]["check"] == "next_step"
    common = ["--config", str(tmp_path / "7b-short.json"), "--model", "llama-tiny", "--seq-len", "32",
              "--steps", "12", "--eval-every", "12", "--val-batches", "1", "--no-progress", "--no-plot",
              "--data", str(write_corpus(tmp_path))]
    hybrid = train.main(common + ["--out", str(tmp_path / "hybrid")])
    plain = train.main(common + ["--out", str(tmp_path / "plain"), "--baseline"])
    assert hybrid["steps_done"] == plain["steps_done"] == 12
    stats = json.loads((tmp_path / "hybrid" / "summary.json").read_text())
    flat = json.dumps(stats)
    assert '"predict": 4' in flat and '"free_velocity_copy": false' in flat
    # TRAIN7B_GRADIENT=int4-factored: the hybrid arm's Predict steps take their own gradient in the compact state
    env = dict(os.environ, TRAIN7B_GRADIENT="int4-factored")
    subprocess.run([sys.executable, "-c", snippet.replace("/tmp/7b-short.json", str(tmp_path / "7b-grad.json"))],
                   cwd=PRESET_DIR.parent, capture_output=True, text=True, check=True, env=env)
    grad = json.loads((tmp_path / "7b-grad.json").read_text())["hybrid_predict"]
    assert grad["predictor"] == {"direction": "gradient"} and grad["memory"]["gradient_state_dtype"] == "int4-factored"
    common[1] = str(tmp_path / "7b-grad.json")
    assert train.main(common + ["--out", str(tmp_path / "grad")])["steps_done"] == 12
    flat = json.dumps(json.loads((tmp_path / "grad" / "summary.json").read_text()))
    assert '"predict": 4' in flat and '"gradient_nonfinite_steps": 0' in flat


@pytest.mark.skipif(not __import__("engine_utils").aio_available(),
                    reason="DeepSpeed's async_io op cannot be built here (libaio missing)")
def test_the_7b_nvme_preset_trains_on_the_cpu_with_its_optimizer_swapped(tmp_path):
    """7b-24gb-nvme as a user runs it (its nvme_path set to a folder of theirs), with a small model
    in sub-groups DeepSpeed swaps (1 MiB and up): plain ZeRO-Infinity and the hybrid both train
    through ds-hybrid train, the hybrid takes Predict steps on the device path ("auto" where the
    masters swap), its swap files are on the drive, and it reports no snapshot."""
    from engine_utils import NVME_AIO
    from ds_hybrid import train
    from spawn import write_corpus
    cfg = json.loads((PRESET_DIR / "7b-24gb-nvme.json").read_text())
    cfg["gradient_accumulation_steps"] = 1
    cfg["zero_optimization"]["sub_group_size"] = 300_000
    cfg.update(NVME_AIO)
    hybrid = cfg["hybrid_predict"]
    hybrid.update(warmup_steps=4, full_steps=2, min_predict_steps=2, max_predict_steps=2, check="next_step",
                  confidence_threshold=0.0,   # (a loose band: the runs are kept, so their catch-up swaps too)
                  divergence={"rel_tolerance": 0.5, "z_threshold": 100.0, "max_loss_ratio": 10.0})
    runs = {}
    for arm in ("plain", "hybrid"):
        swap = tmp_path / f"swap-{arm}"
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(swap)
        (tmp_path / f"{arm}.json").write_text(json.dumps(cfg))
        runs[arm] = train.main(["--config", str(tmp_path / f"{arm}.json"), "--model", "gpt2-tiny", "--seq-len", "32",
                                "--steps", "12", "--eval-every", "12", "--val-batches", "1", "--no-progress",
                                "--no-plot", "--data", str(write_corpus(tmp_path)), "--out", str(tmp_path / arm)]
                               + (["--baseline"] if arm == "plain" else []))
        assert any(f.stat().st_size > 2 ** 20 for f in swap.rglob("*.swp")), f"{arm}: nothing swapped to {swap}"
    assert runs["plain"]["steps_done"] == runs["hybrid"]["steps_done"] == 12
    stats = json.loads((tmp_path / "hybrid" / "summary.json").read_text())["statistics"]
    assert stats["offload_predict"] == "device" and stats["snapshot_bytes"] == 0
    assert stats["predict_steps"] == 4 and stats["predict_accepted"] > 0, stats


def _fifty_on_cpu(tmp_path, arm: str, max_in_cpu: "int | None" = None, live: int = 2_000_000) -> dict:
    """50b-24gb-nvme's ds_config for SWAPPED_LLAMA on the CPU: its ZeRO settings and DeepSpeed's
    prefetch, with sub-groups, swap buffers and the parameters DeepSpeed keeps gathered scaled
    down with the model (buffers of 3e8 values to 6e5, so the live and reused values from 1e9 to
    2e6: as many parameters held as swap buffers hold), its nvme paths a folder of the test's,
    micro-batches of the engine tests, and an eager Predict cycle."""
    from engine_utils import MICRO, NVME_AIO
    cfg = json.loads((PRESET_DIR / "50b-24gb-nvme.json").read_text())
    cfg.update(NVME_AIO, gradient_accumulation_steps=1, train_micro_batch_size_per_gpu=MICRO)
    zo = cfg["zero_optimization"]
    zo["sub_group_size"] = 1_000_000
    zo["offload_param"]["buffer_size"] = 600_000
    zo["stage3_max_live_parameters"] = zo["stage3_max_reuse_distance"] = live
    if max_in_cpu is not None:
        zo["offload_param"]["max_in_cpu"] = max_in_cpu
    for key in ("offload_optimizer", "offload_param"):
        zo[key]["nvme_path"] = str(tmp_path / f"swap-{arm}")
    cfg["hybrid_predict"].update(warmup_steps=3, full_steps=2, min_predict_steps=2, max_predict_steps=2,
                                 check="next_step", confidence_threshold=0.0, correction_steps=0,
                                 divergence={"rel_tolerance": 0.5, "z_threshold": 100.0, "max_loss_ratio": 10.0})
    return cfg


@pytest.mark.slow
@pytest.mark.skipif(not __import__("engine_utils").aio_available(),
                    reason="DeepSpeed's async_io op cannot be built here (libaio missing)")
def test_the_50b_nvme_preset_trains_on_the_cpu_with_its_weights_swapped(tmp_path):
    """50b-24gb-nvme (both offloads on NVMe) on a model whose MLP matrices DeepSpeed swaps: plain
    ZeRO-Infinity and the hybrid train through Predict runs with DeepSpeed's prefetch on, the 16-bit
    weights on the drive, and the hybrid's Predict steps on the device path (no snapshot): the
    preset's drift step, and the gradient step in 4 bits (``--set predictor.direction=gradient
    --set memory.gradient_state_dtype=int4-factored``)."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
    from engine_utils import SWAPPED_LLAMA, Batches, make_engine
    for arm in ("plain", "hybrid", "gradient"):
        cfg = _fifty_on_cpu(tmp_path, arm)
        if arm == "gradient":
            cfg["hybrid_predict"]["predictor"] = {"direction": "gradient"}
            cfg["hybrid_predict"]["memory"] = {"offload_predict": "auto", "gradient_state_dtype": "int4-factored"}
        engine = make_engine(cfg, plain=arm == "plain", **SWAPPED_LLAMA)
        assert engine.zero_optimization_stage() == 3
        on_drive = [p for p in engine.module.parameters() if p.ds_tensor.final_location == OffloadDeviceEnum.nvme]
        assert on_drive and all(engine.optimizer.fp16_partitioned_groups_flat[i] is None
                                for i in range(len(engine.optimizer.fp16_groups)))   # (max_in_cpu 0)
        batches, phases = Batches(seed=3), []
        for _ in range(12):
            if arm == "plain":
                loss = engine(**batches.micro()).loss
                engine.backward(loss)
                engine.step()
            else:
                phases.append(engine.train_step(batches.step()).phase)
        if arm != "plain":
            st = engine.statistics()
            assert st["offload_predict"] == "device" and st["snapshot_bytes"] == 0 and phases.count("predict") >= 4
            # the planner counts the host buffer the engine allocated (sub-groups of this model's partitions)
            from ds_hybrid.memory import planner as pl
            from ds_hybrid.memory.counts import shape_of
            groups = tuple(tuple(p.ds_numel for p in g["params"]) for g in engine.optimizer.trainable_param_groups)
            spec = pl.preset_spec(cfg)
            assert st["shard_swap_buffer_bytes"] == 2 * max(pl.swapped_sub_groups(
                shape_of(engine.module, "swapped-llama", group_tensors=groups), spec)) > 0


@pytest.mark.slow
@pytest.mark.skipif(not __import__("engine_utils").aio_available(),
                    reason="DeepSpeed's async_io op cannot be built here (libaio missing)")
@pytest.mark.parametrize("max_in_cpu", [1_500_000, 0], ids=["split", "all-on-nvme"])
def test_why_the_50b_nvme_preset_keeps_no_weights_in_host_memory(max_in_cpu, tmp_path):
    """The preset's ``offload_param.max_in_cpu`` is 0. Where a value splits the model (part of the
    16-bit weights in host memory, the rest on NVMe; at 50B the old 1e9 did), plain DeepSpeed
    0.19.8 can fail at its second forward: its NVMe prefetch gives a parameter a second swap buffer
    (here with DeepSpeed's defaults for the parameters it keeps gathered, SWAPPED_LLAMA in six
    swap buffers). The same engine with every 16-bit partition on NVMe trains."""
    import deepspeed
    from engine_utils import NVME_AIO, SWAPPED_LLAMA, Batches, ds_config, make_engine
    cfg = ds_config(stage=3, bf16=True, offload_opt="nvme", offload_param="nvme", nvme_path=str(tmp_path), **NVME_AIO)
    cfg["zero_optimization"]["sub_group_size"] = 1_000_000
    cfg["zero_optimization"]["offload_param"].update(max_in_cpu=max_in_cpu, buffer_size=600_000, buffer_count=6)
    engine = make_engine(cfg, plain=True, **SWAPPED_LLAMA)
    flats = engine.optimizer.fp16_partitioned_groups_flat
    assert None in flats and (any(f is not None for f in flats) if max_in_cpu else all(f is None for f in flats))
    batches = Batches(seed=3)

    def steps(n: int) -> None:
        for _ in range(n):
            engine.backward(engine(**batches.micro()).loss)
            engine.step()
    if max_in_cpu:
        with pytest.raises(AssertionError, match="already assigned swap buffer id"):
            steps(2)
        assert deepspeed.__version__.startswith("0.19.")
    else:
        steps(3)
        assert engine.global_steps == 3
