"""Memory: a per-step profiler for training runs, and a planner that says which preset fits.

``profiler.py``  ``MemoryProfiler``: host RSS (and its per-step peak), the torch CUDA allocator's
                 allocated / reserved / peak, NVML device memory, pinned host memory; per phase,
                 spikes, CSV, text report, PNG timeline.
``planner.py``   ``ds-hybrid plan``: per-device GPU, per-node CPU and NVMe memory of every preset for a
                 model and a machine, from DeepSpeed's model-state estimators plus activations and
                 ds_hybrid's own buffers; picks the fastest preset that fits.
``bench.py``     ``ds-hybrid memory-bench``: host memory per phase on CPU, Full against Predict.

Nothing here imports torch, DeepSpeed or matplotlib at import time.
"""
from .profiler import MemoryProfiler, MemorySample, detect_spikes

__all__ = ["MemoryProfiler", "MemorySample", "detect_spikes"]
