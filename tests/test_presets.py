"""Every ds_configs/ preset: parsed by DeepSpeed and by our section, batch identity, documented, as described."""
import json
from pathlib import Path

import pytest
from deepspeed.runtime import config as ds_config_module
from deepspeed.runtime.config import DeepSpeedConfig

from ds_hybrid.config import parse_hybrid_config
from ds_hybrid.arguments import resolve_config

PRESET_DIR = Path(__file__).resolve().parent.parent / "ds_configs"
PRESETS = sorted(PRESET_DIR.glob("*.json"))
EXPECTED = {"tiny-cpu", "gpt2-124m", "1b-16gb", "7b-24gb", "50b-24gb-nvme"}


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

    for name in ("1b-16gb", "7b-24gb", "50b-24gb-nvme"):
        hybrid = parse_hybrid_config(json.loads((PRESET_DIR / f"{name}.json").read_text()))
        assert hybrid.snapshot_device == "cpu", f"{name}: the snapshot of a big model belongs in host memory"
