"""``predictor.gradient_checkpointing``: whether a gradient Predict step's own backward recomputes
the model's checkpointed blocks.

Under activation checkpointing a forward keeps only each block's input and the backward runs the
block's forward again: a real step needs that to fit its activations beside DeepSpeed's buffers.
A gradient Predict step (``grad_predict.py``) runs a forward and backward of its own, outside
DeepSpeed's gradient path; where the memory allows, its forward keeps the blocks' activations and
its backward recomputes nothing, about one forward less a step. The gradient is the same bit for
bit: the recomputed forward is the same forward (``tests/test_grad_recompute.py``).

``auto`` decides per micro-batch size (its tokens), once, from a measurement: a Predict step of a
new size that runs with the run's moments already allocated runs checkpointed, what it holds at
the end of its forward and at its peak is read, and the activations the blocks would keep are
counted as the planner counts them (``memory.counts.activation_bytes``, checked against autograd's
saved tensors in ``tests/test_plan.py``). Every rank takes the largest size any rank has and the
answer of the rank with least room, so all run the same backward (ZeRO 3's per-parameter
all-reduces pair up in the backward's order).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch

MARGIN = 0.9       # of a GPU's limit: the planner's 10% for the allocator's fragmentation
HOST_SHARE = 0.5   # of the host's available memory, split between the node's ranks


def checkpointed_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks under transformers' activation checkpointing (its ``gradient_checkpointing`` flag)."""
    return [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextlib.contextmanager
def checkpointing_off(module: torch.nn.Module) -> Iterator[None]:
    """The model's checkpointed blocks run plainly inside (their forward keeps its activations,
    a backward recomputes nothing), checkpointed again after."""
    layers = checkpointed_layers(module)
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def micro_tokens(batch: Any) -> int | None:
    """The tokens of one micro-batch: the elements of its ``input_ids`` (or its first tensor)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    if isinstance(batch, torch.Tensor):
        return batch.numel() if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = micro_tokens(v)
        if n:
            return n
    return None


def extra_activation_bytes(module: torch.nn.Module, tokens: int) -> float | None:
    """What a micro-batch of ``tokens`` holds at the start of its backward with the blocks run
    plainly beyond what it holds checkpointed, by the planner's count: every block's activations
    less their inputs, plus the backward's first transient; None for a model without a
    transformers config to count from."""
    from .memory.counts import activation_bytes, shape_of
    try:
        shape = shape_of(module, type(module).__name__)
    except (AttributeError, TypeError, ValueError):
        return None
    lp = next((p.element_size() for p in module.parameters() if p.is_floating_point()), 4)
    plain, ckpt = (activation_bytes(shape, tokens, 1, lp, c) for c in (False, True))
    return float(plain["layers"] - ckpt["layers"] + plain["working"])


def limit_bytes(device: torch.device, local_ranks: int) -> float | None:
    """What this rank may hold: on a GPU ``MARGIN`` of the process's limit (the device's memory
    times ``torch.cuda.set_per_process_memory_fraction``'s fraction); on a CPU ``HOST_SHARE`` of
    the host's available memory now, split between the node's ranks. None where unknown (a torch
    that cannot say the fraction: a cap set by ``--gpu-mem-cap`` would go unseen)."""
    if device.type == "cuda":
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if get_fraction is None:
            return None
        return torch.cuda.get_device_properties(device).total_memory * get_fraction(device) * MARGIN
    from .memory.counts import host_memory_bytes
    available = host_memory_bytes(key="MemAvailable")
    return None if available is None else available * HOST_SHARE / max(1, local_ranks)


class Recompute:
    """One engine's ``predictor.gradient_checkpointing``: ``scope`` around each gradient Predict
    step's forward and backward."""

    def __init__(self, setting: bool | str, module: torch.nn.Module,
                 max_over_ranks: Callable[[list[float]], list[float]], local_ranks: int | None = None):
        self.setting = setting
        self.module = module
        self._max = max_over_ranks   # the element-wise maximum over the ranks (a collective)
        self._local = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.fits_up_to = 0                  # auto: the largest micro-batch (tokens) shown to fit run plainly
        self.too_big_from: int | None = None  # auto: the smallest shown not to
        self.decisions: list[dict] = []      # auto: each decision and what it was made from
        self.steps = {"recomputed": 0, "plain": 0}   # gradient Predict steps of a checkpointed model

    @contextlib.contextmanager
    def scope(self, batches: list, ready: bool = True) -> Iterator[None]:
        """One Predict step's forward and backward, checkpointed or not. ``ready``: the run's
        moments are allocated (the measured peak then holds them), so ``auto`` may decide."""
        layers = checkpointed_layers(self.module)
        if self.setting is True or not layers:
            self.steps["recomputed"] += int(bool(layers))
            yield
            return
        if self.setting == "auto":
            # (every rank takes the same size, so every rank takes the same branch below)
            tokens = int(self._max([float(max((micro_tokens(b) or 0) for b in batches))])[0])
            plain = 0 < tokens <= self.fits_up_to
            measure = (not plain and ready and tokens > 0
                       and (self.too_big_from is None or tokens < self.too_big_from))
        else:
            plain, measure, tokens = True, False, 0
        if plain:
            self.steps["plain"] += 1
            with checkpointing_off(self.module):
                yield
            return
        self.steps["recomputed"] += 1
        if not measure:
            yield
            return
        device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
        ends: list[float] = []   # on a GPU: what the allocator held at the end of each forward
        hook = (self.module.register_forward_hook(lambda *_: ends.append(torch.cuda.memory_allocated(device)))
                if device.type == "cuda" else None)
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()
        self._decide(tokens, device, max(ends, default=None),
                     float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None)

    def _decide(self, tokens: int, device: torch.device, forward_end: float | None, peak: float | None) -> None:
        """After a checkpointed step of ``tokens`` a micro-batch: whether a plain one fits on every rank.

        On a GPU a plain step needs what its checkpointed twin held at the end of its forward plus
        the blocks' activations (``extra_activation_bytes``), or the twin's peak (the allocator's
        since its last reset, which the memory profiler makes each step) where that is higher:
        through the backward the activations go as the gradients come, about as much of each a
        block, so the two never peak together. On a CPU it needs the activations out of the host's
        available memory (``limit_bytes``)."""
        extra = extra_activation_bytes(self.module, tokens)
        limit = limit_bytes(device, self._local)
        need = None
        if extra is not None:
            need = extra if device.type != "cuda" else max(peak or 0.0, (forward_end or 0.0) + extra)
        fits = need is not None and limit is not None and need <= limit
        agreed = self._max([0.0 if fits else 1.0])[0] == 0.0
        if agreed:
            self.fits_up_to = max(self.fits_up_to, tokens)
        else:
            self.too_big_from = tokens if self.too_big_from is None else min(self.too_big_from, tokens)
        self.decisions.append({"tokens": tokens, "plain": agreed, "extra_activation_bytes": extra,
                               "forward_end_bytes": forward_end, "peak_bytes": peak, "need_bytes": need,
                               "limit_bytes": limit, "device": device.type})

    def statistics(self) -> dict:
        return {"setting": self.setting, "steps": dict(self.steps), "fits_up_to_tokens": self.fits_up_to,
                "too_big_from_tokens": self.too_big_from, "decisions": list(self.decisions)}
