"""Compact storage for the predictor's per-parameter buffers: fp32, bf16, int8 or int4.

The drift velocity (and the Adam direction cached for a Predict run) is one value per
parameter of the rank's master partition: 4 bytes in fp32, the same as the fp32
masters themselves. ``CompactBuffer`` stores it as

* ``fp32``: exact;
* ``bf16``: 2 bytes per value, round to nearest even (8 bits of mantissa: the
  velocity is an average whose own noise is far larger than that);
* ``int8``: 1 byte per value plus one fp32 scale per block of ``BLOCK`` values
  (absmax / 127), with *stochastic* rounding. An exponential average stored with
  round-to-nearest gets stuck: once an element's change per step is under half a
  quantization step it never moves again (a value of 1 step decayed by 0.95 rounds
  back to 1). Stochastic rounding is unbiased, so the stored average decays and
  grows as the fp32 one does, with noise. The random numbers come from a generator
  seeded by the caller with (seed, step, partition): the same on a rerun and after a
  resume, with no generator state to checkpoint. On the CPU (masters in host memory:
  ``offload_optimizer``, the CPU accelerator) drawing one number per value is the slowest
  part of a store (torch's CPU generator is serial: ~4 ns a value, seconds per step at 1B
  parameters), so there the noise is a window of a fixed table of uniform numbers at an
  offset drawn from that generator: each value's noise is still uniform on [0, 1), which
  is all unbiasedness needs (stores of up to ``SMALL_STORE`` values draw directly). The
  table is a hash of the index (``noise_table_values``), so the C++ fold computes a
  window's values from its offset instead of reading them.
* ``int4``: half a byte per value (two to a byte, the first in the low bits) plus the block's
  fp32 scale (absmax / 7), values -7..7, rounded stochastically as int8 is. Only the compact
  gradient state's first moment uses it (``compact_moments.py``); the kernels take fp32, bf16
  and int8.

Values are read and written in chunks (``load`` / ``store`` take a range), so the
fp32 transient is one chunk, not one partition. Callers on the hot path pass a reusable
work buffer (``scratch``): a fresh 16 MiB tensor per chunk costs page faults and zeroing on
the CPU, where the masters of an ``offload_optimizer`` run live.
"""
from __future__ import annotations

import contextlib
import threading

import torch

BLOCK = 256          # int8: values per absmax scale
CHUNK = 1 << 22      # elements per fp32 transient (16 MiB); a multiple of BLOCK
DTYPES = ("fp32", "bf16", "int8", "int4")
BLOCKED = ("int8", "int4")   # an fp32 scale per BLOCK values
_LEVELS = {"int8": 127.0, "int4": 7.0}
NOISE_TABLE_SEED = 0x5EED
SMALL_STORE = 1 << 16   # values; up to this a CPU store draws its noise from the generator
_noise_table: torch.Tensor | None = None
_scratch: dict[tuple[str, int | None, int, str], torch.Tensor] = {}
_owner = threading.local()   # .name: the host worker this thread is (its own set of work buffers)


def scratch(device: torch.device | str, slot: int = 0, numel: int = CHUNK) -> torch.Tensor:
    """A flat fp32 work buffer on ``device`` of at least ``min(numel, CHUNK)`` values. On the CPU
    one per ``slot``, kept and reused across calls (grown when a caller needs more; the caller
    must not hold two uses of one slot at once); on an accelerator a fresh tensor: its caching
    allocator already reuses the block, and nothing stays allocated between steps. A thread inside
    ``worker_scratch(name)`` has slots of its own, so it can run beside the main thread's work."""
    dev = torch.device(device)
    n = max(1, min(int(numel), CHUNK))
    if dev.type != "cpu":
        return torch.empty(n, dtype=torch.float32, device=dev)
    key = (dev.type, dev.index, slot, getattr(_owner, "name", ""))
    buf = _scratch.get(key)
    if buf is None or buf.numel() < n:
        buf = _scratch[key] = torch.empty(n, dtype=torch.float32, device=dev)
    return buf


@contextlib.contextmanager
def worker_scratch(name: str):
    """Within the block this thread's ``scratch`` buffers are ``name``'s, not the main thread's:
    for a host worker (one thread per name at a time) whose chunked work overlaps the step's."""
    before = getattr(_owner, "name", "")
    _owner.name = name
    try:
        yield
    finally:
        _owner.name = before


def noise_table_values(index: torch.Tensor) -> torch.Tensor:
    """The noise table's values at ``index`` (int64, in [0, CHUNK)): 24 bits of a hash of the
    index, ``(mix32(index ^ NOISE_TABLE_SEED) >> 8) / 2**24``, uniform on [0, 1) in torch.rand's
    24-bit steps. A hash, not a generator's draws, so that ``kernels/host_fold.cpp`` computes a
    table value where it would read it: the int8 fold inside DeepSpeed's step is bound by memory
    beside a GPU, and the table's 4 bytes a value were 4 of its 34."""
    return (_mix32(index ^ NOISE_TABLE_SEED) >> 8).to(torch.float32) * 2.0 ** -24


def _cpu_noise(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` <= CHUNK uniform [0, 1) values for a CPU store: a window of a fixed table
    (2 x CHUNK, built once) at a random offset, without copying (``noise_offset`` finds the offset
    again). Small stores draw directly: they are cheap, and a small model then never builds the
    32 MiB table."""
    global _noise_table
    if n <= SMALL_STORE:
        return torch.rand(n, generator=generator)
    if _noise_table is None:
        t = noise_table_values(torch.arange(CHUNK, dtype=torch.int64))
        _noise_table = torch.cat([t, t])
    off = int(torch.randint(0, CHUNK, (1,), generator=generator))
    return _noise_table[off:off + n]


def noise_offset(noise: torch.Tensor) -> int:
    """Where ``noise`` (from ``_cpu_noise``) starts in the noise table, or -1 where it was drawn
    directly: element k of a window at offset ``off`` is ``noise_table_values((off + k) % CHUNK)``."""
    table = _noise_table
    if table is None or noise.numel() == 0 or noise.untyped_storage().data_ptr() != table.untyped_storage().data_ptr():
        return -1
    return int(noise.storage_offset())


class CompactBuffer:
    """A flat fp32 vector of ``numel`` values on ``device``, stored as ``dtype``."""

    def __init__(self, numel: int, dtype: str, device: torch.device | str, pin: bool = False):
        if dtype not in DTYPES:
            raise ValueError(f"CompactBuffer: dtype must be one of {DTYPES}, got {dtype!r}")
        self.numel, self.dtype, self.device = int(numel), dtype, torch.device(device)
        kw = dict(device=self.device, pin_memory=pin)
        if dtype == "fp32":
            self.data = torch.zeros(self.numel, dtype=torch.float32, **kw)
        elif dtype == "bf16":
            self.data = torch.zeros(self.numel, dtype=torch.bfloat16, **kw)
        else:
            nblocks = (self.numel + BLOCK - 1) // BLOCK
            if dtype == "int8":
                self.data = torch.zeros(nblocks * BLOCK, dtype=torch.int8, **kw)
            else:   # (two values a byte)
                self.data = torch.zeros(nblocks * BLOCK // 2, dtype=torch.uint8, **kw)
            self.scale = torch.zeros(nblocks, dtype=torch.float32, **kw)

    @classmethod
    def wrap(cls, data: torch.Tensor, scale: torch.Tensor | None, dtype: str, numel: int) -> "CompactBuffer":
        """A buffer over existing tensors (no copy): ``numel`` values stored in ``data`` (int8:
        whole blocks, with their ``scale``), e.g. one staged chunk of a buffer on another device."""
        buf = cls.__new__(cls)
        buf.numel, buf.dtype, buf.device, buf.data = int(numel), dtype, data.device, data
        if dtype in BLOCKED:
            buf.scale = scale
        return buf

    def window(self, start: int, end: int) -> "CompactBuffer":
        """Values ``[start, end)`` as a buffer over this one's storage (no copy; ``start`` on a
        block boundary): a chunk of a partition's velocity (``step_fusion.py``)."""
        if start % BLOCK or not 0 <= start <= end <= self.numel:
            raise ValueError(f"CompactBuffer.window: [{start}, {end}) must start on a multiple of {BLOCK} "
                             f"and lie in the {self.numel} values")
        if self.dtype not in BLOCKED:
            return CompactBuffer.wrap(self.data[start:end], None, self.dtype, end - start)
        b0, b1 = start // BLOCK, -(-end // BLOCK)
        per = 2 if self.dtype == "int4" else 1   # values a stored byte
        return CompactBuffer.wrap(self.data[start // per:b1 * BLOCK // per], self.scale[b0:b1], self.dtype,
                                  end - start)

    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.dtype in BLOCKED:
            n += self.scale.numel() * self.scale.element_size()
        return n

    def chunks(self):
        """(start, end) ranges of at most ``CHUNK`` values that start on a block boundary."""
        for start in range(0, self.numel, CHUNK):
            yield start, min(start + CHUNK, self.numel)

    def load(self, start: int = 0, end: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values ``[start, end)`` as fp32: a new tensor, or a view of ``out`` (a flat fp32
        work buffer, e.g. ``scratch``) when it is large enough."""
        end = self.numel if end is None else end
        b0, b1 = start // BLOCK, (end + BLOCK - 1) // BLOCK
        fits = out is not None and out.numel() >= (b1 - b0) * BLOCK
        if self.dtype not in BLOCKED:
            if not fits:
                return self.data[start:end].to(torch.float32, copy=True)
            dst = out[:end - start]
            dst.copy_(self.data[start:end])
            return dst
        if self.dtype == "int4":
            packed = self.data[b0 * BLOCK // 2:b1 * BLOCK // 2]
            q = torch.stack([packed & 15, packed >> 4], dim=1).view(b1 - b0, BLOCK).to(torch.int8).sub_(8)
        else:
            q = self.data[b0 * BLOCK:b1 * BLOCK].view(b1 - b0, BLOCK)
        if fits:   # one pass: int8 x fp32 scale -> fp32, no int8 -> fp32 temporary
            vals = out[:(b1 - b0) * BLOCK]
            torch.mul(q, self.scale[b0:b1].unsqueeze(1), out=vals.view(b1 - b0, BLOCK))
        else:
            vals = (q.float() * self.scale[b0:b1].unsqueeze(1)).flatten()
        return vals[start - b0 * BLOCK:end - b0 * BLOCK]

    def store(self, values: torch.Tensor, start: int = 0, generator: torch.Generator | None = None,
              clobber: bool = False, noise_key: int | None = None) -> None:
        """Write fp32 ``values`` at ``start``. int8 needs ``start`` on a block boundary and
        ``generator`` (on this buffer's device) for its stochastic rounding, or ``noise_key``
        (the noise ``sr_uniform(noise_key, index)``, as the shard fold's kernel draws it);
        ``clobber`` lets it quantize in ``values``' memory (the caller's work buffer) instead of
        a copy."""
        end = start + values.numel()
        if self.dtype not in BLOCKED:
            self.data[start:end].copy_(values)
            return
        if start % BLOCK:
            raise ValueError(f"CompactBuffer.store: {self.dtype} writes start on a multiple of {BLOCK} (got {start})")
        b0, nb = start // BLOCK, (values.numel() + BLOCK - 1) // BLOCK
        if values.numel() == nb * BLOCK:   # whole blocks (every chunk but a partition's last)
            blocks = values.reshape(nb, BLOCK)
        else:
            padded = torch.zeros(nb * BLOCK, dtype=torch.float32, device=values.device)
            padded[:values.numel()] = values
            blocks = padded.view(nb, BLOCK)
            clobber = True
        # absmax per block without an |x| copy: max(max x, -min x) (on the CPU 3x faster than
        # abs().amax(), 20x faster than vector_norm(inf))
        levels = _LEVELS[self.dtype]
        scale = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(levels)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        x = blocks.div_(safe.unsqueeze(1)) if clobber and blocks.is_contiguous() else blocks / safe.unsqueeze(1)
        if noise_key is not None:
            x.add_(sr_uniform(noise_key, start, x.numel(), x.device).view_as(x))
        elif x.device.type == "cpu" and x.numel() <= CHUNK:
            x.add_(_cpu_noise(x.numel(), generator).view_as(x))
        else:
            x.add_(torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32))
        q = x.floor_().clamp_(-levels, levels)
        if self.dtype == "int4":   # (-7..7 stored as 1..15, the pair's first value in the low bits)
            nib = q.add_(8).to(torch.uint8).view(-1, 2)
            self.data[b0 * BLOCK // 2:(b0 + nb) * BLOCK // 2].copy_(nib[:, 0] | (nib[:, 1] << 4))
        else:
            # integral values: the float -> int8 cast in copy_ is exact (no int8 temporary)
            self.data[b0 * BLOCK:(b0 + nb) * BLOCK].view(nb, BLOCK).copy_(q)
        self.scale[b0:b0 + nb].copy_(scale)

    def zero_(self) -> None:
        self.data.zero_()
        if self.dtype in BLOCKED:
            self.scale.zero_()

    def state_dict(self) -> dict:
        sd = {"dtype": self.dtype, "numel": self.numel, "data": self.data.detach().cpu().clone()}
        if self.dtype in BLOCKED:
            sd["scale"] = self.scale.detach().cpu().clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd["dtype"] != self.dtype or sd["numel"] != self.numel:
            raise ValueError(f"saved buffer is {sd['dtype']} x {sd['numel']}, this one {self.dtype} x {self.numel}")
        self.data.copy_(sd["data"])
        if self.dtype in BLOCKED:
            self.scale.copy_(sd["scale"])


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """``(a * b) mod 2**32`` for int64 ``a`` in [0, 2**32): in 16-bit halves of ``b``, so no
    product leaves int64."""
    return (a * (b & 0xFFFF) + (((a * (b >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The "lowbias32" integer hash (C. Wellons) on int64 values in [0, 2**32), as
    ``kernels/fused_update.cu``'s ``dsh_mix32`` on uint32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _index_hash(key: int, start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """32 random bits (int64) for elements ``start .. start + n`` of a draw keyed by ``key``: a hash
    of (key, index), ``dsh_mix32(lo ^ dsh_mix32(hi ^ key))`` as ``kernels/fused_update.cu`` takes it."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return _mix32((i & 0xFFFFFFFF) ^ _mix32((i >> 32) ^ (int(key) & 0xFFFFFFFF)))


def sr_bits(key: int, start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """16 random bits (int32) for elements ``start .. start + n`` of a draw keyed by ``key`` (a
    uint32): a hash of (key, index), so a rerun and a resume draw the same bits and the CUDA kernel
    (``dsh_sr_bits``) draws these exactly, with no generator state."""
    return (_index_hash(key, start, n, device) & 0xFFFF).to(torch.int32)


def sr_uniform(key: int, start: int, n: int, device: torch.device | str) -> torch.Tensor:
    """Uniform numbers in [0, 1) (fp32, 24 random bits each, exact) for elements ``start .. start +
    n`` of a draw keyed by ``key``: the hash of ``sr_bits``, so the CUDA kernel (``dsh_uniform``)
    draws these exactly; the int8 rounding of the shard fold's kernel (``kernels.shard_fold``)."""
    return (_index_hash(key, start, n, device) >> 8).to(torch.float32).mul_(2.0 ** -24)


def stochastic_round_bf16_(dst: torch.Tensor, src: torch.Tensor, key: int, start: int = 0) -> None:
    """``dst`` (bf16) = ``src`` (fp32, clobbered) rounded stochastically: up with probability equal
    to the fraction of a bf16 step that the value lies above the one below. Unbiased, so updates
    smaller than half a bf16 step still move the weights on average (round to nearest would drop
    every one of them). 16 random bits (``sr_bits(key, start + k)`` for the k-th value) are added to
    the 16 bits a bf16 value drops, then those are cleared: a carry rounds the magnitude up, inf and
    a quiet NaN (their low 16 bits zero) stay what they are, and the largest finite values may round
    up to inf."""
    if src.numel() == 0:
        return
    src.view(torch.int32).add_(sr_bits(key, start, src.numel(), src.device)).bitwise_and_(-65536)   # 0xFFFF0000
    dst.copy_(src)   # exact: the dropped bits are zero
