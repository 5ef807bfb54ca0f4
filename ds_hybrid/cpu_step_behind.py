"""A real step's CPU Adam step run behind the Predict run after it (``memory.cpu_step_behind``).

Under ZeRO-Offload a real step's dear part is DeepSpeed's CPU Adam step (441 of 869 ms for
llama-1b beside an H200, 2026-11-27). Run late, asynchronously (ZeRO-Offload's delayed parameter
update, ZenFlow), it leaves the next steps' gradients one update behind, which cost 25-67% in loss
on the CPU preset and most of a gradient Predict run's worth (docs/memory.md, "The CPU window").
Here nothing is behind: the GPU takes the same Adam step itself, from the step's clipped gradient
and the moments from before it (``GradientPredict.cover``), and the Predict run goes on from those
weights and moments, while DeepSpeed's own step of the fp32 masters and the host moments runs on a
host thread behind the run. The masters and moments are then DeepSpeed's exactly; the GPU's
weights differ from ``round(masters)`` by the rounding of the GPU's step only, and the run's commit
(the masters taking the 16-bit weights' change) carries that difference, not a stale update.

Only DeepSpeed's C++ op call is deferred (``DeepSpeedCPUAdam.step`` still counts its step, reads
the group's LR and hands the op its tensors, which the call keeps): its arguments are values or
tensors that nothing writes before the thread has run them (the next writer is the next real
step's backward, which joins the thread first). DeepSpeed's step would then copy the masters, not
yet stepped, into the 16-bit weights (a cast on the host and a copy up, 1.9 GB at 970M in bf16):
wasted work, which ``skip_copies_into`` drops. The engine then either covers the step (a run
follows: the GPU's step starts from the 16-bit weights as they are) or runs the calls at once and
copies the stepped masters into the weights, the one copy DeepSpeed's step would have made.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode


class AdamCall:
    """One deferred ``adam_update`` of DeepSpeed's CPU Adam op on a partition."""

    def __init__(self, op: Any, args: tuple):
        self._op, self._args = op, args
        (self.opt_id, self.step, self.lr, self.beta1, self.beta2, self.eps, self.weight_decay,
         self.bias_correction, self.params, self.grads, self.exp_avg, self.exp_avg_sq) = args

    def run(self) -> None:
        self._op.adam_update(*self._args)


class DeferredCpuAdam:
    """Stands in for a ``DeepSpeedCPUAdam``'s op module (``ds_opt_adam``) during one step:
    ``adam_update`` calls are recorded, not run; everything else is the op's own."""

    def __init__(self, op: Any):
        self._op = op
        self.calls: list[AdamCall] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def adam_update(self, *args) -> None:
        self.calls.append(AdamCall(self._op, args))


@contextlib.contextmanager
def deferred(cpu_adam: torch.optim.Optimizer) -> Iterator[DeferredCpuAdam]:
    """For the block, ``cpu_adam``'s op calls are recorded on the yielded proxy. If the block
    raises, the calls recorded so far run before the error goes on (DeepSpeed counted the steps)."""
    proxy = DeferredCpuAdam(cpu_adam.ds_opt_adam)
    cpu_adam.ds_opt_adam = proxy
    try:
        yield proxy
    except BaseException:
        run_all(proxy.calls)
        raise
    finally:
        cpu_adam.ds_opt_adam = proxy._op


def run_all(calls: list[AdamCall]) -> None:
    for call in calls:
        call.run()


def _where(t: torch.Tensor) -> tuple:
    return t.device, t.data_ptr(), t.numel(), t.dtype


class skip_copies_into(TorchFunctionMode):
    """For the block, ``dst.copy_(src)`` does nothing where ``dst`` is one of ``targets`` (the same
    memory, length and dtype: a ``.data`` view of it too); ``skipped`` counts the dropped copies.
    A torch function mode, so it sees DeepSpeed's own calls without patching DeepSpeed's code:
    here the step's copy of the masters into its pinned 16-bit buffer and from there into this
    rank's 16-bit partition, both of which the deferred step would make from masters not yet
    stepped."""

    def __init__(self, targets: list[torch.Tensor]):
        super().__init__()
        self._targets = {_where(t) for t in targets}
        self.skipped = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (the mode is off inside its own handler: data_ptr() and func() below are not re-entered)
        if func is torch.Tensor.copy_ and _where(args[0]) in self._targets:
            self.skipped += 1
            return args[0]
        return func(*args, **(kwargs or {}))
