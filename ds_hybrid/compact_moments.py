"""A gradient Predict run's Adam moments in about a byte a parameter or half of one, its gradient
folded in as the backward produces it (``memory.gradient_state_dtype: int8-factored`` or
``int4-factored``).

At 7B under 24 GB the device path's moments in bf16 (4 bytes a parameter) and the step's whole
gradient (2 more) do not fit beside 13 GB of bf16 weights (docs/memory.md). Here, per parameter
slice of this rank's partition:

* the **first moment** is int8 (or int4) blocks with stochastic rounding (``quant.CompactBuffer``,
  the int8 velocity's format), one buffer per slice so that a parameter's gradient updates whole
  blocks of its own;
* the **second moment**, held for the run as the device path holds it, is a matrix's row and
  column means (Adafactor's rank-one fit, ``v_ij ~ r_i c_j / mean(r)``, as
  ``benchmarks/grad_step_study.py``'s ``factored_rms``), over the whole rows the slice covers;
  what is not a whole row (a 1-D parameter, a slice's partial first and last rows) stays fp32;
* the **gradient** never exists whole: a tensor hook per parameter all-reduces the parameter's
  gradient over the ranks, clips it by its own norm to its share of the clip threshold
  (``share_p * gradient_clipping``: the share of the whole norm that parameter had in the
  previous Predict step of the run, or at the run's first step, of ``sqrt(sum v)``, the norm
  the second moment expects), folds it into the first moment and hands autograd a zero-stride
  zero in its place. The weights move after the backward, from the stored moments.

Measured on the study's model (``--state-dtype int8-factored --predict-clip tensor``): 0.94-0.95
of a real step at 1 : 3 and 1 : 7, 0.30 at an eighth of the batch (1 : 15), against 0.95-0.96 and
0.30 with the whole gradient's own clip; ``int4-factored``: 1.00, 1.06 and 0.38, and with these
first shares (``--predict-clip tensor-v``) 1.04, 1.03 and 0.36 (docs/memory.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .quant import CHUNK, CompactBuffer, scratch


@dataclass
class SliceMoments:
    """One parameter's slice of a partition: values ``[ps, ps + n)`` of the parameter, ``[ms, ms + n)``
    of the partition. ``cols``: the parameter's row length (0: not a matrix); the slice's
    ``head`` values before its first whole row and ``tail`` after its last have their second
    moment in ``dense_v``; the ``rows`` whole rows between, in ``r`` and ``c``."""
    param: torch.nn.Parameter
    ps: int
    ms: int
    n: int
    m: CompactBuffer
    cols: int = 0
    head: int = 0
    rows: int = 0
    r: torch.Tensor | None = None   # the whole rows' means of v (rows,)
    c: torch.Tensor | None = None   # their column means (cols,)
    r_mean: float = 0.0
    dense_v: torch.Tensor | None = None   # head and tail values of v, fp32 (head + tail,)
    v_sum: float = 0.0   # sum of v over the slice (the factored sum is exact: sum r_i * cols)

    @property
    def tail(self) -> int:
        return self.n - self.head - self.rows * self.cols

    def nbytes(self) -> int:
        n = self.m.nbytes()
        for t in (self.r, self.c, self.dense_v):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def _layout(p: torch.nn.Parameter, ps: int, n: int) -> tuple[int, int, int]:
    """(cols, head, rows) for a slice: the whole rows it covers of the parameter seen as
    ``(numel / shape[-1], shape[-1])``; a 1-D parameter, or a slice shorter than a row, is all dense.
    (ZeRO 3's partitioned parameter is empty between its gathers: its shape is ``ds_shape``.)"""
    shape = getattr(p, "ds_shape", None) or p.shape
    if len(shape) < 2 or n < shape[-1]:
        return 0, n, 0
    cols = int(shape[-1])
    head = (-ps) % cols
    if head >= n:
        return 0, n, 0
    rows = (n - head) // cols
    return (cols, head, rows) if rows else (0, n, 0)


class CompactMoments:
    """The run's moments for every slice of this rank's partitions, on ``device``."""

    def __init__(self, slices: list[list[tuple]], params: list, device: torch.device, dtype: str = "int8"):
        self.device = device
        self.dtype = dtype   # the first moment's CompactBuffer format: int8 or int4
        self.params = params   # every trained parameter, in one order on every rank
        # per partition, the slices (None where the partition has no optimizer state)
        self.parts: list[list[SliceMoments] | None] = []
        self.by_param: dict = {}
        self._slices = slices
        self.shares: dict = {}   # each parameter's share of the clip threshold in the next step

    # ------------------------------------------------------------------ building
    @torch.no_grad()
    def build(self, parts: list, key: int, all_reduce, first: bool = True) -> None:
        """The first moment from each partition's ``exp_avg`` (int8, rounded stochastically with
        ``key``'s draws), the second from its ``exp_avg_sq`` (factored where it lies, the means
        copied here). ``all_reduce`` sums the per-parameter ``sum v`` over the ranks (collective).
        ``first`` False: the first moment is left as allocated (a resume loads it: ``load_state_dict``)."""
        self.start()
        for i, part in enumerate(parts):
            self.build_one(i, part, key, first)
        self.finish(all_reduce)

    def start(self) -> None:
        """``build`` a partition at a time: ``start``, ``build_one`` for each partition in order
        (under NVMe swap, each inside DeepSpeed's step while it is swapped in), then ``finish``."""
        self.parts, self.by_param = [], {}

    @torch.no_grad()
    def build_one(self, i: int, part, key: int, first: bool = True) -> None:
        """Partition ``i``'s slices (the partitions before it built already)."""
        if len(self.parts) != i:
            raise RuntimeError(f"CompactMoments.build_one: partition {i} after {len(self.parts)} built")
        if "exp_avg" not in part.state or part.master.numel() == 0:
            self.parts.append(None)
            return
        m_src, v_src = part.state["exp_avg"].view(-1), part.state["exp_avg_sq"].view(-1)
        slices = []
        for k, (p, ps, ms, n) in enumerate(self._slices[i]):
            cols, head, rows = _layout(p, ps, n)
            s = SliceMoments(p, ps, ms, n, CompactBuffer(n, self.dtype, self.device), cols, head, rows)
            if first:
                self._store_m(s, m_src[ms:ms + n], _mix(key, i, k))
            v = v_src[ms:ms + n]
            body = v[head:head + rows * cols].view(rows, cols) if rows else None
            dense = torch.cat([v[:head], v[head + rows * cols:]]) if rows else v
            s.dense_v = dense.to(self.device, torch.float32, copy=True)
            s.v_sum = float(dense.sum(dtype=torch.float64))
            if body is not None:
                r = body.mean(dim=1, dtype=torch.float32)
                s.r, s.c = r.to(self.device), body.mean(dim=0, dtype=torch.float32).to(self.device)
                s.r_mean = float(r.mean(dtype=torch.float64))
                s.v_sum += float(r.sum(dtype=torch.float64)) * cols
            slices.append(s)
            self.by_param.setdefault(p, []).append(s)
        self.parts.append(slices)

    def finish(self, all_reduce) -> None:
        """The run's first step clips each parameter to its share of the norm v expects (collective)."""
        self.shares = self._v_shares(all_reduce)

    def _v_shares(self, all_reduce) -> dict:
        """Each parameter's share of ``sqrt(sum v)`` over all ranks: the proportions of the gradient's
        norm the second moment expects (``E[g^2]`` per value)."""
        params = self.params
        sums = torch.zeros(len(params), dtype=torch.float64, device=self.device)
        for k, p in enumerate(params):
            sums[k] = sum(s.v_sum for s in self.by_param.get(p, ()))
        all_reduce(sums)
        sums = sums.cpu()
        total = math.sqrt(float(sums.sum()))
        return {p: math.sqrt(max(float(s), 0.0)) / (total + 1e-12) for p, s in zip(params, sums)}

    def take_shares(self, sq: dict) -> None:
        """The next step's shares: each parameter's of this step's gradient norm (``sq``: its squared
        norm, the same on every rank)."""
        total = math.sqrt(sum(sq.values()))
        self.shares = {p: math.sqrt(x) / (total + 1e-12) for p, x in sq.items()}

    def _store_m(self, s: SliceMoments, src: torch.Tensor, key: int) -> None:
        for a in range(0, s.n, CHUNK):
            b = min(a + CHUNK, s.n)
            vals = scratch(self.device, 0, b - a)[:b - a].copy_(src[a:b])
            _store(s.m, vals, a, _mix(key, a, 0))

    @torch.no_grad()
    def reset_m(self, parts: list, key: int) -> None:
        """Every slice's first moment taken again from the optimizer's (a non-finite gradient
        went into it: its NaN/Inf is in the moment)."""
        for i, part in enumerate(parts):
            for k, s in enumerate(self.parts[i] or ()):
                self._store_m(s, part.state["exp_avg"].view(-1)[s.ms:s.ms + s.n], _mix(key, i, k))

    @torch.no_grad()
    def fold_real_step(self, s: SliceMoments, g: torch.Tensor, beta1: float, beta2: float, key: int,
                       copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> None:
        """A real step's clipped gradient into slice ``s``'s moments (``g`` its values, any device):
        ``m = beta1 m + (1 - beta1) g`` as ``fold_chunk`` folds a Predict step's, and
        ``v = beta2 v + (1 - beta2) g^2`` on the dense head and tail as they are and on the whole
        rows' row and column means by the same update (a mean is linear: they are then the means
        of the stepped ``v``); ``r_mean`` and ``v_sum`` follow. Each ``CHUNK`` of ``g`` crosses to the
        state's device once, for both. ``memory.cpu_step_behind``'s cover of a real step in this
        state (``GradientPredict._cover_compact``): no host moment crosses, the gradient does.
        With a ``copy(dst, src)`` (``GradientPredict._copy``: through ``staging.Stager``'s pinned
        buffers) each chunk crosses into a ``dtype`` tensor, cast on the host (7B's gradient is 26 GB
        in fp32: as a pageable copy a chunk, about 3 s at the pageable rate ``staging`` records, as
        long as the CPU step it covers); without one, ``g``'s values in fp32 as they are."""
        alpha = torch.full((), 1.0 - beta1, dtype=torch.float32, device=self.device)
        lo_body, hi_body, tail0 = s.head, s.head + s.rows * s.cols, s.n - s.tail
        if s.rows:
            rows = torch.zeros(s.rows, dtype=torch.float32, device=self.device)   # each row's sum of g^2
            cols = torch.zeros(s.cols, dtype=torch.float32, device=self.device)   # each column's
        s.dense_v.mul_(beta2)
        for a in range(0, s.n, CHUNK):
            b = min(a + CHUNK, s.n)
            if copy is None:
                gc = g[a:b].to(self.device, torch.float32)
            else:   # (the cross dtype's values, then fp32 for the arithmetic, as without a copy)
                crossed = torch.empty(b - a, dtype=dtype, device=self.device)
                copy(crossed, g[a:b])
                gc = crossed.float()
            self.fold_chunk(s, gc, a, alpha, beta1, True, key)
            sq = gc.square()   # (not in place: off a GPU, gc may be the caller's own gradient)
            if a < s.head:
                e = min(b, s.head)
                s.dense_v[a:e].add_(sq[:e - a], alpha=1.0 - beta2)
            if s.tail and b > tail0:
                t = max(a, tail0)
                s.dense_v[s.head + t - tail0:s.head + b - tail0].add_(sq[t - a:b - a], alpha=1.0 - beta2)
            lo, hi = max(a, lo_body), min(b, hi_body)
            if lo < hi:   # (whole rows of it, the chunk's partial first and last rows padded with zeros)
                off, r0 = (lo - lo_body) % s.cols, (lo - lo_body) // s.cols
                n_rows = (off + hi - lo + s.cols - 1) // s.cols
                block = sq.new_zeros(n_rows * s.cols)
                block[off:off + hi - lo] = sq[lo - a:hi - a]
                block = block.view(n_rows, s.cols)
                rows[r0:r0 + n_rows] += block.sum(dim=1)
                cols += block.sum(dim=0)
        v_sum = float(s.dense_v.sum(dtype=torch.float64))
        if s.rows:
            s.r.mul_(beta2).add_(rows, alpha=(1.0 - beta2) / s.cols)
            s.c.mul_(beta2).add_(cols, alpha=(1.0 - beta2) / s.rows)
            s.r_mean = float(s.r.mean(dtype=torch.float64))
            v_sum += float(s.r.sum(dtype=torch.float64)) * s.cols
        s.v_sum = v_sum

    def refresh_shares(self, all_reduce) -> None:
        """The next step's shares from the second moment as it stands (``fold_real_step`` changed it). Collective."""
        self.shares = self._v_shares(all_reduce)

    # ------------------------------------------------------------------ a step
    def fold_scale(self, p: torch.nn.Parameter, norm: torch.Tensor, clip: float, beta1: float,
                   weight: float) -> torch.Tensor:
        """``fold``'s factor of ``p``'s gradient, ``(1 - beta1) * weight / coef``: a 0-d fp32 tensor on
        ``norm``'s device (no host read)."""
        alpha = torch.full((), (1.0 - beta1) * weight, dtype=torch.float32, device=norm.device)
        if clip > 0.0:
            alpha = alpha / ((norm + 1e-6) / (clip * self.shares.get(p, 1.0) + 1e-12)).clamp_min(1.0)
        return alpha

    @torch.no_grad()
    def fold(self, p: torch.nn.Parameter, g: torch.Tensor, norm: torch.Tensor, clip: float, beta1: float,
             weight: float, first: bool, key: int) -> None:
        """``m = beta1 * m + (1 - beta1) * weight * g / coef`` on this rank's slices of ``p`` (``first``:
        the step's first micro-batch decays ``m``; later ones only add), ``g`` the parameter's whole
        flat gradient (mean over the ranks), ``coef`` its clip: ``norm`` (a 0-d fp32 tensor on ``g``'s
        device, so that no hook waits for a GPU) against ``clip`` times its share."""
        slices = self.by_param.get(p, ())
        if not slices:   # (none on this rank: nothing to wait for)
            return
        step = self.fold_scale(p, norm, clip, beta1, weight).to(self.device)
        for s in slices:
            self.fold_range(s, g[s.ps:s.ps + s.n], 0, s.n, step, beta1, first, key)

    @torch.no_grad()
    def fold_range(self, s: SliceMoments, g: torch.Tensor, a: int, b: int, step: torch.Tensor, beta1: float,
                   first: bool, key: int) -> None:
        """``fold`` of values ``[a, b)`` of slice ``s`` (``a`` a multiple of ``CHUNK``), ``g[0]`` the
        gradient's value ``a``: cut at ``CHUNK``, so that the roundings and their draws do not depend
        on who calls (the hook, or ``GradientPredict._fold_behind``'s host thread)."""
        for c in range(a, b, CHUNK):
            self.fold_chunk(s, g[c - a:min(c + CHUNK, b) - a], c, step, beta1, first, key)

    @torch.no_grad()
    def fold_chunk(self, s: SliceMoments, g: torch.Tensor, a: int, step: torch.Tensor, beta1: float,
                   first: bool, key: int) -> None:
        """``fold`` of values ``[a, a + len(g))`` of slice ``s`` (``a`` a multiple of ``CHUNK``): ``g``
        those values of the gradient (any device), ``step`` the ``fold_scale`` in ``m``'s memory."""
        b = a + g.numel()
        vals = s.m.load(a, b, out=scratch(self.device, 0, b - a))
        if first:
            vals.mul_(beta1)
        vals.addcmul_(g.to(vals.device), step)
        _store(s.m, vals, a, _mix(key, s.ms, a))

    @torch.no_grad()
    def step(self, i: int, shard: torch.Tensor, adam: Callable[..., None], key: int) -> None:
        """Adam's step of partition ``i``'s 16-bit ``shard`` from the stored moments, a range at a
        time, the moments widened to fp32 for it: ``adam(x, m, v, key)`` takes Adam's step of ``x``
        with the second moment held (``GradientPredict._held_adam``: ``kernels.held_adam_step``, or
        beside host memory ``host_kernels.held_adam``)."""
        for k, s in enumerate(self.parts[i] or ()):
            for a, b, v in self._v_ranges(s):
                m = s.m.load(a, b)
                adam(shard[s.ms + a:s.ms + b], m, v.contiguous(), _mix(key, k, a))

    def _v_ranges(self, s: SliceMoments):
        """``(a, b, v)``: ranges of the slice with their second moment in fp32 (the dense head, the
        factored rows a chunk of rows at a time, the dense tail)."""
        if s.head:
            yield 0, s.head, s.dense_v[:s.head]
        if s.rows:
            per = max(1, CHUNK // s.cols)
            scale = 1.0 / max(s.r_mean, torch.finfo(torch.float32).tiny)
            for r0 in range(0, s.rows, per):
                r1 = min(r0 + per, s.rows)
                v = torch.outer(s.r[r0:r1] * scale, s.c).reshape(-1)
                yield s.head + r0 * s.cols, s.head + r1 * s.cols, v
        if s.tail:
            yield s.n - s.tail, s.n, s.dense_v[s.head:]

    # ------------------------------------------------------------------ the run's end
    @torch.no_grad()
    def write_m(self, i: int, exp_avg: torch.Tensor) -> None:
        """Partition ``i``'s first moment into the optimizer's ``exp_avg`` (a kept run)."""
        flat = exp_avg.view(-1)
        for s in self.parts[i] or ():
            for a in range(0, s.n, CHUNK):
                b = min(a + CHUNK, s.n)
                flat[s.ms + a:s.ms + b].copy_(s.m.load(a, b))

    def nbytes(self) -> int:
        return sum(s.nbytes() for sl in self.parts if sl for s in sl)

    def state_dict(self, v: bool = False) -> dict:
        """The first moments and the next step's shares; the second moment is the optimizer's, read
        again at a resume, unless ``v`` (a covered run's, ``fold_real_step``'s: saved with it)."""
        sd = {"m": [None if sl is None else [s.m.state_dict() for s in sl] for sl in self.parts],
              "shares": [self.shares.get(p, 0.0) for p in self.params]}
        if v:
            cpu = lambda t: None if t is None else t.detach().to("cpu", copy=True)  # noqa: E731
            sd["v"] = [None if sl is None else [{"r": cpu(s.r), "c": cpu(s.c), "dense": cpu(s.dense_v),
                                                 "r_mean": s.r_mean, "v_sum": s.v_sum} for s in sl]
                       for sl in self.parts]
        return sd

    def load_state_dict(self, sd: dict) -> bool:
        """``state_dict()``'s; False (nothing loaded) where the slices differ."""
        saved = sd["m"]
        if len(saved) != len(self.parts) or len(sd["shares"]) != len(self.params):
            return False
        for sl, sv in zip(self.parts, saved):
            if (sl is None) != (sv is None) or (sl is not None and [s.n for s in sl] != [d["numel"] for d in sv]):
                return False
        for sl, sv in zip(self.parts, saved):
            for s, d in zip(sl or (), sv or ()):
                s.m.load_state_dict(d)
        for sl, sv in zip(self.parts, sd.get("v") or ()):   # (a covered run's own second moment)
            for s, d in zip(sl or (), sv or ()):
                for name, t in (("r", s.r), ("c", s.c), ("dense", s.dense_v)):
                    if t is not None:
                        t.copy_(d[name])
                s.r_mean, s.v_sum = d["r_mean"], d["v_sum"]
        self.shares = dict(zip(self.params, sd["shares"]))
        return True


def _store(buf: CompactBuffer, vals: torch.Tensor, start: int, key: int) -> None:
    """``buf.store`` of an fp32 work chunk at ``start``, its stochastic rounding drawn from ``key``: on
    a GPU a hash of (key, index) per value; in host memory a window of the noise table at an offset
    a generator seeded by ``key`` draws (``quant._cpu_noise``: the hash's integer passes took seconds
    a step there). The same draws on a rerun and after a resume either way."""
    if vals.device.type == "cpu":
        buf.store(vals, start, generator=torch.Generator().manual_seed(key), clobber=True)
    else:
        buf.store(vals, start, noise_key=key, clobber=True)


def _mix(key: int, a: int, b: int) -> int:
    """A uint32 key for the draws of (``key``, ``a``, ``b``): the stochastic roundings of different
    slices, ranges and steps draw different bits."""
    return (((int(key) * 1_000_003 + int(a)) * 1_000_033 + int(b)) * 2_654_435_761) & 0xFFFFFFFF
