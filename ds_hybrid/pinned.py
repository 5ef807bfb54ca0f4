"""Page-locked host memory without torch's power-of-two rounding.

torch's pinned-memory allocator (``CachingHostAllocator``) rounds every request up to the next
power of two, so that freed blocks can be reused by size. DeepSpeed's offload buffers are pinned
once and never freed, so the rounding is pure waste: a 1.8 GB fp32 partition takes 2.1 GB, a
llama-7b MLP weight's 86 MiB bf16 partition 128 MiB. On an H200 with llama-1b under ZeRO-Offload
the profiler saw 10.3 GB pinned where the buffers' own sizes (fp32 masters and gradient partition
per layer group, the int8 velocity) add up to about 8.8 GB. At 7B (``7b-24gb``: fp32 partitions of
up to 10^9 values, every bf16 parameter partition pinned) the same rounding of those sizes comes
to roughly 10 GB (arithmetic, not a measurement), on a lent machine whose 125 GiB the run
already nearly fills.

torch (2.10 on) can stop rounding above a size (``pinned_max_round_threshold_mb``) and stop
caching above a size (``pinned_max_cached_size_mb``). Both are set to the same value: a block
above it is then neither rounded nor kept for reuse (torch versions before August 2026 could hand
a larger request a smaller cached block when the round threshold was below the cache limit).
GPU-only: on a machine without CUDA nothing is pinned and nothing is set.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

KEYS = ("pinned_max_round_threshold_mb", "pinned_max_cached_size_mb")
ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")

# The hybrid's own pinned buffers (``staging``), named here where the planner, which imports no
# torch, counts them: values per buffer (``quant.CHUNK``: a chunk starts on a quantisation block
# boundary; a test checks the two agree), buffers per dtype of a ``Stager`` and of a ``QueuedDownloads``.
STAGE_CHUNK = 1 << 22
STAGER_BUFFERS = 2
QUEUE_BUFFERS = 8


def limit_pinned_rounding(threshold_mb: int) -> str | None:
    """Stop torch rounding (and caching) pinned host blocks above ``threshold_mb`` MiB. Call it
    before DeepSpeed pins its buffers (``ds-hybrid train --pinned-round-mb``). Returns the
    settings applied, or None where nothing was set: ``threshold_mb`` 0, no CUDA, a torch without
    the setting, or the user's own ``PYTORCH_ALLOC_CONF`` / ``PYTORCH_CUDA_ALLOC_CONF`` already
    naming one of the two keys (theirs is kept)."""
    if threshold_mb < 0:
        raise ValueError(f"--pinned-round-mb: must be 0 (torch's rounding) or more (got {threshold_mb})")
    if threshold_mb == 0:
        return None
    import torch
    if not torch.cuda.is_available():
        return None
    for var in ENV:
        if any(key in os.environ.get(var, "") for key in KEYS):
            logger.info("%s sets the pinned allocator's limits: left as it is", var)
            return None
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if get is None or put is None:
        logger.warning("torch %s cannot limit the pinned allocator's rounding: pinned buffers are rounded up "
                       "to powers of two", torch.__version__)
        return None
    settings = ",".join(f"{key}:{int(threshold_mb)}" for key in KEYS)
    current = get()
    try:
        put(f"{current},{settings}" if current else settings)
    except (RuntimeError, ValueError) as err:   # a torch whose allocator does not know the keys
        logger.warning("torch %s refused the pinned allocator's limits (%s): pinned buffers are rounded up to "
                       "powers of two", torch.__version__, str(err).splitlines()[0] if str(err) else err)
        return None
    return settings


def can_limit_pinned_rounding() -> bool:
    """Whether this torch has the allocator settings ``limit_pinned_rounding`` sets (whatever the
    machine's accelerator: the planner asks it on the machine it plans on)."""
    import torch
    return all(hasattr(torch._C, name) for name in ("_accelerator_getAllocatorSettings",
                                                    "_accelerator_setAllocatorSettings"))


def pinned_block_bytes(nbytes: int, round_above_mb: int = 0) -> int:
    """What torch's pinned allocator holds for a request of ``nbytes``: the next power of two
    (``CachingHostAllocator``), or the request itself where it is above ``round_above_mb`` MiB
    and the rounding is limited there (``limit_pinned_rounding``; 0: every block rounded).
    Checked against an H200's pinned peak to the MiB (``tests/test_planner_pinned.py``)."""
    n = int(nbytes)
    if n <= 0:
        return 0
    if round_above_mb and n > round_above_mb * 2**20:
        return n
    return 1 << (n - 1).bit_length()
