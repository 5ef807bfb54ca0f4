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
import queue
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from .pinned import QUEUE_BUFFERS, STAGE_CHUNK, STAGER_BUFFERS   # (STAGE_CHUNK is quant.CHUNK: a chunk
# fits quant.scratch's work buffers and starts on a quantisation block; 8 MiB a buffer in bf16)


def side_stream(streams: dict, device: torch.device):
    """``streams``' side stream for ``device`` (made on first use), or None off a GPU."""
    if device.type != "cuda":
        return None
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


class Stager:
    """Two staging buffers per dtype (pinned where a GPU is one end), a side stream per GPU,
    and the events that say when a buffer's last copy has finished. Calls from one thread at
    a time (each ``HostWorker`` job, or the main thread while none runs)."""

    def __init__(self, chunk: int = STAGE_CHUNK):
        self.chunk = int(chunk)
        self._bufs: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        self._events: dict[tuple[torch.dtype, bool], list] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._turn: dict[tuple[torch.dtype, bool], int] = {}   # the buffer each dtype's next chunk takes

    def _buffers(self, dtype: torch.dtype, pinned: bool) -> tuple[list[torch.Tensor], list]:
        key = (dtype, pinned)
        if key not in self._bufs:
            self._bufs[key] = [torch.empty(self.chunk, dtype=dtype, pin_memory=pinned) for _ in range(STAGER_BUFFERS)]
            self._events[key] = [None] * STAGER_BUFFERS
        return self._bufs[key], self._events[key]

    def _next(self, dtype: torch.dtype, pinned: bool) -> int:
        """The buffer the next chunk takes: in turn across calls, so that a caller that copies a
        chunk a call (``CompactMoments.fold_real_step``) casts the next into the other buffer while
        the last one crosses, as one call's chunks do."""
        key = (dtype, pinned)
        j = self._turn.get(key, 0)
        self._turn[key] = (j + 1) % STAGER_BUFFERS
        return j

    def _stream(self, device: torch.device):
        return side_stream(self._streams, device)

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
        for a in range(0, n, self.chunk):
            b, j = min(a + self.chunk, n), self._next(dst.dtype, stream is not None)
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
        for a in range(0, n, self.chunk):
            b, j = min(a + self.chunk, n), self._next(src.dtype, stream is not None)
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


class QueuedDownloads:
    """Copies from a GPU into host memory that the calling thread does not wait for: each chunk
    of a flat device tensor crosses into one of ``slots`` pinned buffers on a side stream, and one
    host thread waits for it and hands it to the caller's ``take(staged, a, b)``, chunk after
    chunk in the order they were queued. ``drain`` waits for them all.

    For the ZeRO 3 gradient Predict step with ``offload_param: cpu`` (``grad_predict``): each
    parameter's gradient share goes into sums in host memory from a hook on autograd's thread.
    Waited for there, every share stalls the backward until the GPU has caught up with the hook
    and the host has added it (on an H200 with llama-1b, 2026-11-27, the step's own forward and
    backward took 1961 ms against DeepSpeed's 919); queued, the hook returns at once, and blocks
    only when all the buffers are in flight. Where both ends are host memory (DeepSpeed's CPU
    accelerator) the copy into a plain buffer is made at once and the host thread still adds it,
    so the CPU tests run the same queue."""

    def __init__(self, chunk: int = STAGE_CHUNK, slots: int = QUEUE_BUFFERS):
        self.chunk, self.slots = int(chunk), int(slots)
        self._bufs: dict[tuple[torch.dtype, bool], list[torch.Tensor]] = {}
        self._free: dict[tuple[torch.dtype, bool], queue.SimpleQueue] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._worker: ThreadPoolExecutor | None = None   # one thread, made on first use: the takes in order
        self._pending: list[Future] = []
        self.chunks = 0   # chunks queued since this was made
        self.wait_seconds = {"slot": 0.0, "drain": 0.0}   # the caller blocked: for a free buffer, in drain

    def _buffers(self, dtype: torch.dtype, pinned: bool):
        key = (dtype, pinned)
        if key not in self._bufs:
            self._bufs[key] = [torch.empty(self.chunk, dtype=dtype, pin_memory=pinned) for _ in range(self.slots)]
            self._free[key] = queue.SimpleQueue()
            for j in range(self.slots):
                self._free[key].put(j)
        return self._bufs[key], self._free[key]

    def _stream(self, device: torch.device):
        return side_stream(self._streams, device)

    def _submit(self, job: Callable[[], None]) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ds_hybrid-shares")
        self._pending.append(self._worker.submit(job))

    @torch.no_grad()
    def put(self, src: torch.Tensor, take: Callable[[torch.Tensor, int, int], None]) -> None:
        """Queue a flat ``src`` (final on the current stream now; kept alive until its copies
        have finished): each chunk ``[a, b)`` is handed to ``take`` on the host thread."""
        n = src.numel()
        stream = self._stream(src.device)
        bufs, free = self._buffers(src.dtype, stream is not None)
        after = None
        if stream is not None:   # the copies wait for the work queued so far (src's producers), no more
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(src.device))
            stream.wait_event(after)
        device = torch.cuda.current_device() if stream is not None else None
        for a in range(0, n, self.chunk):
            b = min(a + self.chunk, n)
            t0 = time.perf_counter()
            j = free.get()   # blocks while every buffer is in flight
            self.wait_seconds["slot"] += time.perf_counter() - t0
            staged = bufs[j][:b - a]
            done = None
            if stream is None:
                staged.copy_(src[a:b])
            else:
                with torch.cuda.stream(stream):
                    staged.copy_(src[a:b], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)

            def job(staged=staged, j=j, a=a, b=b, done=done, keep=src) -> None:
                if device is not None:
                    torch.cuda.set_device(device)   # (a new thread's current device is GPU 0)
                try:
                    if done is not None:
                        done.synchronize()
                    with torch.no_grad():   # (grad mode is per thread)
                        take(staged, a, b)
                finally:
                    free.put(j)
            self._submit(job)
            self.chunks += 1

    def drain(self) -> None:
        """Wait until every queued chunk has been taken; re-raises the first error of a take."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        try:
            for f in pending:
                f.result()
        finally:
            self.wait_seconds["drain"] += time.perf_counter() - t0
