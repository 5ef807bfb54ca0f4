"""ds_hybrid/pinned.py: pinned host blocks above a size are not rounded up to a power of two.

The decision runs everywhere (torch's setter stubbed where there is no GPU); whether torch on a
GPU then pins a block at its own size is the GPU-marked test (the GPU stage's ``tests``)."""
from __future__ import annotations

import logging

import pytest
import torch

from ds_hybrid import pinned


class FakeSettings:
    """torch._C's allocator-settings getter and setter, recording what was set."""

    def __init__(self, current: str = ""):
        self.current, self.calls = current, []

    def get(self) -> str:
        return self.current

    def put(self, text: str) -> None:
        self.calls.append(text)
        self.current = text


@pytest.fixture
def fake_gpu(monkeypatch):
    settings = FakeSettings("expandable_segments:True")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", settings.get, raising=False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.put, raising=False)
    for var in pinned.ENV:
        monkeypatch.delenv(var, raising=False)
    return settings


def test_both_limits_are_added_to_the_allocators_settings(fake_gpu):
    applied = pinned.limit_pinned_rounding(64)
    assert applied == "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:64"
    # the settings already there are kept; the two keys are set to one value (rounding off above
    # it, and no caching above it either)
    assert fake_gpu.calls == ["expandable_segments:True," + applied]


def test_a_users_own_pinned_setting_is_kept(fake_gpu, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "pinned_max_round_threshold_mb:8")
    assert pinned.limit_pinned_rounding(64) is None
    assert fake_gpu.calls == []


def test_zero_keeps_torchs_rounding_and_a_negative_size_is_refused(fake_gpu):
    assert pinned.limit_pinned_rounding(0) is None and fake_gpu.calls == []
    with pytest.raises(ValueError, match="--pinned-round-mb"):
        pinned.limit_pinned_rounding(-1)


def test_a_torch_without_the_setting_is_said_and_left_alone(fake_gpu, monkeypatch, caplog):
    monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings")
    with caplog.at_level(logging.WARNING, logger="ds_hybrid.pinned"):
        assert pinned.limit_pinned_rounding(64) is None
    assert "powers of two" in caplog.text


def test_a_torch_that_refuses_the_keys_is_said_and_training_goes_on(fake_gpu, monkeypatch, caplog):
    def refuse(text):
        raise RuntimeError("Unrecognized key 'pinned_max_round_threshold_mb' in Accelerator allocator config.")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    with caplog.at_level(logging.WARNING, logger="ds_hybrid.pinned"):
        assert pinned.limit_pinned_rounding(64) is None
    assert "refused" in caplog.text and "Unrecognized key" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_without_a_gpu_nothing_is_set():
    assert pinned.limit_pinned_rounding(64) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_large_pinned_block_takes_its_own_size_on_the_gpu_machine():
    """After the limit, a 300 MiB + 4 KiB pinned tensor adds about its size to the pinned
    allocator's bytes, not the 512 MiB torch would round it to. (CUDA initialised first: the
    pinned allocator's statistics read empty before; a size class no earlier test pins, so no
    cached block is reused.)"""
    torch.cuda.init()
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.host_memory_stats to read the block size")
    applied = pinned.limit_pinned_rounding(64)
    if applied is None:
        pytest.skip(f"torch {torch.__version__} cannot limit the pinned allocator's rounding")
    key = "allocated_bytes.current"
    before = stats().get(key, 0)
    size = 300 * 2**20 + 4096
    t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    grown = stats().get(key, 0) - before
    assert t.is_pinned()
    assert size <= grown < 512 * 2**20, f"pinned {grown} bytes for {size}: still rounded to a power of two"
