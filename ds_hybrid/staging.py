"""Copies between host memory and a GPU that change the dtype on the host, through two pinned chunks.

The gradient Predict step's device path (``grad_predict``) copies Adam's two moments (fp32, in
host memory under ``offload_optimizer``) to the GPU in bf16 at each run's start, and the run's
first moment back at its end. ``gpu_bf16.copy_(host_fp32)`` does that as a pageable fp32 copy
into a GPU transient, then a cast: measured on an H200 with llama-1b (970M parameters,
``docs/results/offload-gpu-1b-grad.json``) the upload took 0.9 s a run and lifted the GPU peak
by the 3.9 GB transient. Here each chunk is cast on the host into one of two pinned buffers and
copied on a side stream while the host casts the next: PCIe carries the narrow dtype, nothing
pageable crosses it, and the GPU holds no transient. The casts are torch's, so the values are
bit for bit those of the direct copy (round to nearest even, as on the GPU).

Where both tensors are on one device (DeepSpeed's CPU accelerator) the same loop runs with
plain buffers and no stream, so the CPU tests cover its chunking.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .quant import CHUNK

STAGE_CHUNK = CHUNK   # values per staging buffer (8 MiB in bf16): a chunk fits quant.scratch's work buffers


class Stager:
    """Two staging buffers per dtype (pinned where a GPU is one end), a side stream per GPU,
    and the events that say when a buffer's last copy has finished. Calls from one thread at
    a time (each ``HostWorker`` job, or the main thread while none runs)."""

    def __init__(self, chunk: int = STAGE_CHUNK):
        self.chunk = int(chunk)
        self._bufs: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        self._events: dict[tuple[torch.dtype, bool], list] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _buffers(self, dtype: torch.dtype, pinned: bool) -> tuple[list[torch.Tensor], list]:
        key = (dtype, pinned)
        if key not in self._bufs:
            self._bufs[key] = [torch.empty(self.chunk, dtype=dtype, pin_memory=pinned) for _ in range(2)]
            self._events[key] = [None, None]
        return self._bufs[key], self._events[key]

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @staticmethod
    def mark(device: torch.device):
        """An event recorded now on ``device``'s current stream (None off a GPU): pass it as
        ``after`` from a host thread, so its copies wait for exactly the work queued before."""
        if device.type != "cuda":
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev

    def _start(self, stream, device: torch.device, after) -> None:
        if stream is None:
            return
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(device))

    def join(self) -> None:
        """The calling thread's current streams wait for the side streams: for copies a host
        thread made (``upload`` orders its own thread's current stream after them, which is not
        the main thread's when that runs on a stream of its own)."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    @staticmethod
    def _on(stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def _done(events: list, j: int) -> None:
        if events[j] is not None:
            events[j].synchronize()   # the copy that last used buffer j has finished
            events[j] = None

    @staticmethod
    def _record(stream, events: list, j: int) -> None:
        if stream is not None:
            events[j] = torch.cuda.Event()
            events[j].record(stream)

    @torch.no_grad()
    def upload(self, dst: torch.Tensor, src: torch.Tensor, after=None, order: bool = True) -> None:
        """``dst.copy_(src)`` for a flat ``dst`` on the device and a flat ``src`` in host memory,
        cast to ``dst.dtype`` on the host. The copies wait for ``after`` (``mark``), else for
        the work queued on the current stream; work queued on the current stream after this
        call sees the values (``order``; a host thread passes False and its caller calls
        ``join`` once it has joined the thread, so the main thread's kernels queued meanwhile
        do not wait for the copies)."""
        n = dst.numel()
        if src.numel() != n:
            raise ValueError(f"staging: {src.numel()} values into {n}")
        stream = self._stream(dst.device)
        bufs, events = self._buffers(dst.dtype, stream is not None)
        self._start(stream, dst.device, after)   # (dst may be new on the current stream)
        for k, a in enumerate(range(0, n, self.chunk)):
            b, j = min(a + self.chunk, n), k % 2
            self._done(events, j)
            staged = bufs[j][:b - a]
            staged.copy_(src[a:b])   # the cast, on the host
            with self._on(stream):
                dst[a:b].copy_(staged, non_blocking=True)
            self._record(stream, events, j)
        if stream is not None and order:
            torch.cuda.current_stream(dst.device).wait_stream(stream)

    @torch.no_grad()
    def download(self, dst: torch.Tensor | None, src: torch.Tensor,
                 take: Callable[[torch.Tensor, int, int], None] | None = None, after=None) -> None:
        """Each chunk of a flat ``src`` on the device into a staging buffer in host memory (as
        ``src.dtype``), then ``take(staged, a, b)`` on the host, while the next chunk crosses;
        ``take`` defaults to ``dst[a:b].copy_(staged)`` (the cast on the host; ``dst`` is only
        read by it). ``src`` must not change until this returns; the copies wait for ``after``
        as ``upload``'s do."""
        n = src.numel()
        if take is None and (dst is None or dst.numel() != n):
            raise ValueError(f"staging: {src.numel()} values into {None if dst is None else dst.numel()}")
        if take is None:
            def take(staged: torch.Tensor, a: int, b: int) -> None:
                dst[a:b].copy_(staged)
        stream = self._stream(src.device)
        bufs, events = self._buffers(src.dtype, stream is not None)
        self._start(stream, src.device, after)   # src is final
        last = None   # (j, a, b) of the chunk in flight
        for k, a in enumerate(range(0, n, self.chunk)):
            b, j = min(a + self.chunk, n), k % 2
            self._done(events, j)
            with self._on(stream):
                bufs[j][:b - a].copy_(src[a:b], non_blocking=True)
            self._record(stream, events, j)
            if last is not None:
                self._finish(bufs, events, take, *last)
            last = (j, a, b)
        if last is not None:
            self._finish(bufs, events, take, *last)

    def _finish(self, bufs: list, events: list, take: Callable, j: int, a: int, b: int) -> None:
        self._done(events, j)
        take(bufs[j][:b - a], a, b)
