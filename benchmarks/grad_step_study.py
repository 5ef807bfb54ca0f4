"""What a Predict step that takes its gradient on the GPU is worth, against a drift step (plain PyTorch).

Issue 15's regime is ZeRO-Offload: there a real step's dear part is the CPU Adam step and the PCIe copies, not the
forward and backward (on the 1B model under 16 GB the whole step took 801 ms on an H100). A drift Predict step
(``predictor.direction: drift``) costs almost nothing but is worth little: ``direction_study.py`` measured 0.02-0.28
of the loss gap a real step closes, and the ``offload`` suite's hybrid ends 4% above plain ZeRO-Offload at equal
steps. Where the backward is cheap next to the host round trip, a Predict step can afford a gradient, as long as
it stays on the GPU: it needs a preconditioner there, taken from the CPU optimizer's state at the last real step
and held fixed (frozen) through the Predict run. This study measures what such steps are worth, in steps of plain
AdamW, with the same model, data and schedule as ``direction_study.py`` (the ``tiny-cpu`` preset: GPT-2 0.84M,
16 x 128 bytes of the Python standard library's source, AdamW, warmup + cosine to 0.1x, clipping 1.0).

A hybrid run takes ``F`` real AdamW steps, then ``H`` Predict steps, from step ``--start`` on, and repeats; Predict
steps advance the LR schedule. The optimizer's state (``m``, ``v``, step count) sees only the real steps' gradients:
the CPU never receives a Predict step's gradient. Predict steps:

* ``skip``:  nothing moves (the control: the same real steps on the stretched schedule);
* ``drift``: ``lr x v``, ``v`` the running average (beta 0.95) of the real updates per unit LR (the engine's drift,
  step scale 1), no gradient;
* ``rms``:   ``lr x g / (sqrt(v_hat) + eps)`` plus AdamW's decay: the step's own clipped gradient ``g`` with the
  second moment frozen at the last real step (on the GPU: one value per parameter);
* ``adam-local``: ``lr x m_hat / (sqrt(v_hat) + eps)`` plus decay, ``m`` started from the optimizer's at the last
  real step and updated with each Predict step's gradient on the GPU, dropped at the next real step (two values
  per parameter on the GPU; the CPU's ``m`` never sees these gradients);
* ``adam-carry``: the same, but the run's ``m`` goes back to the optimizer at the next real step, so the Predict
  steps' gradients stay in the first moment as a real step's do (on the GPU: ``m`` sent back once per run, as a
  gradient is); ``v`` and the step count still see only the real steps.

``--top-blocks K`` cuts each gradient Predict step's backward at the top ``K`` transformer blocks (the input of the
``K``-th block from the top detached in its forward): those blocks, the final norm and the head (tied to the token
embedding) get the step's gradient; what lies below gets none and, with ``--lower still``, does not move, or with
``--lower still-embedding`` holds the token embedding too (its gradient then comes from the head alone), or with
``--lower coast`` moves by Adam's step from its first moment decayed as a zero gradient decays it. On a GPU such a
step costs its forward plus that share of a backward, and moves (and needs the moments of) that share of the
weights only: the way toward a Predict step of 0.1x a plain ZeRO-Offload step, whose price in loss this measures.

A cut gradient's norm leaves out the blocks below, so clipping it by its own norm (``--cut-clip own``) scales it
less than a real step's gradient is scaled, against a second moment held from real steps; ``--cut-clip last-real``
scales it by the factor that clipped the last real step's gradient instead.

``--window N`` runs each real step's CPU Adam step behind the Predict run that follows it (the CPU window, with
no cover but the Predict steps' own): the run's first ``N`` Predict steps take their gradients at weights without
that real step's update (still on the CPU), which reaches them from step ``N`` on, and the whole run holds the
moments as they were before the real step (a GPU copies them during that step's forward and backward, when
nothing writes them: no copy on a Predict step's path). ``adam-carry`` hands back ``m`` exactly as without the
window, the run's gradients added to the real step's ``m`` (``m`` is linear in them). ``--window-cover last`` moves
the weights those ``N`` steps see by the update before (per unit LR, at the last real step's LR), as a guess of
the missing one. ``--window 0`` holds the moments from before the real step with no stale weights: what the
moments alone cost. On a GPU the window hides the CPU step (441 ms of 847 on the H200's llama-1b) under the run.

``--real-cover compact`` prices the CPU window covered in the compact state (``memory.cpu_step_behind`` with
``memory.gradient_state_dtype`` ``int8-factored`` / ``int4-factored``): the real step before each run is taken by the
GPU while the optimizer's exact step runs behind. As the engine's cover does, it takes the optimizer's moments from
before the step into the compact state and folds the step's gradient (clipped by the whole norm, as DeepSpeed's) into
both: the first moment held in 8 or 4 bits, the second factored (its row and column means are linear in ``g^2``). The
weights take Adam's step from those (the 16-bit weights with ``--weights bf16-sr``), and the run starts from them and
from those moments; the optimizer's exact step is the masters' and the host moments', and the run's commit carries
the difference between the two steps into the masters. What it costs against the uncovered compact path is that one
real step a run taken from the held first moment and the factored second moment.

``--gradient-fraction F`` takes each gradient Predict step's gradient from the first ``round(F x batch)`` sequences
of its batch (at least one; the engine's ``predictor.gradient_batch_fraction``, which under gradient accumulation
takes the first micro-batches): the step still consumes its whole batch from the stream, as the engine's does. On a
GPU under ZeRO-Offload with gradient accumulation such a step costs about ``F`` of the real step's forwards and
backwards (the ``1b-16gb`` preset's 8 micro-batches a step: ``F = 1/8`` is one of them), for a noisier gradient;
what that costs in step worth at a larger batch is what this measures. Beside it, each such run keeps the engine's
estimate of the gradient noise scale (``ds_hybrid.noise_scale``: each share step's squared gradient norm paired with
the real step's before it) and the worth it projects for a share step, ``(1 + x) / (1 + x / F)`` with
``x = B_noise / batch``: whether the engine can tell from norms it already has what its share steps are worth.

``--gradient-lr-scale S`` gives each gradient Predict step ``S`` times the schedule's LR (its decay scaled with
it; the engine's ``predictor.gradient_lr_scale``): whether a noisier share step pays more at a lower rate.
``--gradient-beta1 B`` decays the Predict steps' first moment by ``B`` instead of AdamW's 0.9 (the SDE scaling
rule for Adam takes ``1 - F (1 - 0.9)`` at a share ``F``: a noisier gradient weighs less in the moment).

``--state-dtype bf16`` holds the GPU's copy of the state in bf16 (``sqrt(v_hat)`` and ``m``, rounded after every
update), as a 2-bytes-a-value copy would. ``--state-dtype int8-factored`` holds it in about one byte a parameter,
the least a 7B model's Predict step would need beside its 13 GB of bf16 weights under a 24 GB cap (docs/memory.md):
``m`` in int8 blocks of 256 values with stochastic rounding (``ds_hybrid.quant.CompactBuffer``, the int8 velocity's
format), rounded after every update and handed back so (``adam-carry``); ``v_hat`` of a matrix from its row and
column means (Adafactor's factoring, ``v_ij ~ r_i c_j / mean(r)``, taken once per run as the state is frozen), of a
vector exactly. ``int4-factored`` holds ``m`` in 4 bits (blocks of 256, values -7..7 of an absmax scale, stochastic
rounding; ``held_int4``, the study's own quantizer), half a byte a parameter.

``--predict-clip last-real`` scales each gradient Predict step's gradient by the factor that clipped the last real
step's instead of clipping it by its own norm; ``previous`` by the factor that would have clipped the previous
Predict step's own gradient (the first one, the last real step's); ``expected`` by the factor that would clip the
norm the gradient noise scale expects a share step's gradient to have (``NoiseScale.expected_share_sq``: the last
real step's squared norm plus the trace's share term; the last real step's factor before the first pair, and always
with the whole batch); ``tensor`` clips each parameter's gradient by its own norm to its share of the clip
threshold, the share its gradient had of the last step's (real or Predict) whole norm: where the proportions hold,
the whole gradient's own clip; ``tensor-v`` the same, but a run's first step takes the shares of the norm the
second moment expects (``sqrt(sum v)`` per parameter), as the engine's compact state does
(``memory.gradient_state_dtype: int8-factored``, ``ds_hybrid/compact_moments.py``: it has no per-parameter norms
of a real step's gradient). These are what an update applied as the backward produces each parameter's gradient
can use (it cannot wait for the whole gradient's norm), which is how a 7B step would avoid holding a gradient beside
the weights and moments. A share of the batch has a larger norm than the whole batch (its noise), so the last real
step's factor under-clips it.

Each hybrid run is placed on plain AdamW's curve: plain AdamW runs of several lengths, each on its own full
schedule (the hybrid's real-step count among them), give validation loss against steps; the hybrid's loss read on
that curve is ``n_eq``, the plain steps it is worth. A Predict step's **step worth** is ``(n_eq - n_real) /
n_predict`` (1: as good as a real step; 0: as good as not taking it). At a Predict-step cost ``c`` in plain steps,
the hybrid reaches its loss in ``(n_real + c x n_predict) / n_eq`` of plain AdamW's steps; the table gives the
``c`` at which that is 1 (break-even) and 0.6 (issue 15's goal). ``c`` itself is a GPU number: for ``rms`` and
``adam-local`` it is the forward and backward over a plain ZeRO-Offload step (DeepSpeed's ``wall_clock_breakdown``
in ``benchmarks/gpu_run.sh off1b``); for ``drift``, the drift kernel's pass.

``--eval-every N`` (from step ``--eval-from``) records each run's validation loss along the way, and
``--target-steps N`` then reads the goal's own question the way the bench's budget frontier does: the time each
hybrid run takes to first reach plain AdamW's final loss after ``N`` steps, over plain's shortest time to it over
all its runs, longer plain schedules included (a longer schedule can cross that loss before step ``N``). The
hybrid's time is ``--real-cost r`` per real step and ``c`` per Predict step for each ``--predict-cost c``, in plain
steps: arithmetic on GPU timers, not a measurement of time.

    .venv/bin/python benchmarks/grad_step_study.py --json docs/results/grad-step-study.json   # ~35 min on 2 cores
    .venv/bin/python benchmarks/grad_step_study.py --seeds 1 --schedules 1:3 --modes rms skip --json /tmp/g.json

Prints a table and writes JSON after every run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from direction_study import add_flat, fold_velocity, schedule, setup  # noqa: E402
from ds_hybrid.data import val_batches  # noqa: E402
from ds_hybrid.frontier import time_to_target as crossing  # noqa: E402
from ds_hybrid.grad_predict import batch_samples, batch_share  # noqa: E402
from ds_hybrid.noise_scale import NoiseScale  # noqa: E402
from ds_hybrid.quant import CompactBuffer  # noqa: E402
from ds_hybrid.models import block_list, build_model  # noqa: E402

MODES = ("skip", "drift", "rms", "adam-local", "adam-carry")
GRADIENT_MODES = ("rms", "adam-local", "adam-carry")
BETAS, EPS, WEIGHT_DECAY, CLIP = (0.9, 0.999), 1e-8, 0.01, 1.0   # setup()'s AdamW and the preset's clipping


def real_steps(steps: int, F: int, H: int, start: int) -> int:
    """Real steps in a hybrid run of ``steps``: all before ``start``, then ``F`` of every ``F + H``."""
    n, t, since = 0, 0, 0
    while t < steps:
        if t >= start and since >= F:
            t, since = t + H, 0
            continue
        t, n, since = t + 1, n + 1, since + 1
    return n


def run_key(row: dict) -> tuple:
    """What identifies a run: a plain run by its seed and length; a hybrid also by its Predict settings."""
    if row["mode"] == "plain":
        return ("plain", row["seed"], row["steps"])
    return (row["mode"], row["seed"], row["steps"], row["F"], row["H"], row["start"], row["state_dtype"],
            row.get("weights", "fp32"), row.get("top_blocks"), row.get("lower"), row.get("cut_clip"),
            row.get("window"), row.get("window_cover"), row.get("gradient_fraction", 1.0),
            row.get("gradient_lr_scale", 1.0), row.get("gradient_beta1"), row.get("predict_clip", "own"),
            row.get("real_cover", "none"))


def job_key(args: tuple, kw: dict) -> tuple:
    """``run_key`` of the row that ``train(*args, **kw)`` will return."""
    seed, _, steps, mode, *rest = args
    if mode is None:
        return ("plain", seed, steps)
    F, H, start = rest
    top, window = kw.get("top_blocks"), kw.get("window")
    return (mode, seed, steps, F, H, start, kw.get("state_dtype", "fp32"), kw.get("weights", "fp32"), top,
            kw.get("lower", "still") if top is not None else None,
            kw.get("cut_clip", "own") if top is not None else None,
            window, kw.get("window_cover", "none") if window is not None else None,
            kw.get("gradient_fraction", 1.0), kw.get("gradient_lr_scale", 1.0), kw.get("gradient_beta1"),
            kw.get("predict_clip", "own"), kw.get("real_cover", "none"))


def rebased_first_moment(m_run: torch.Tensor, m_from: torch.Tensor, m_to: torch.Tensor, steps: int) -> torch.Tensor:
    """A first moment ``m_run`` that took ``steps`` gradients starting from ``m_from``, as if started from ``m_to``:
    each update scales what came before by beta1 and adds a gradient's share, so the start's weight is beta1^steps
    (``--window``: the run began from the moment before the real step; the optimizer's has that step's gradient)."""
    return m_run + BETAS[0] ** steps * (m_to - m_from)


def stochastic_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: up with probability the dropped fraction of an ulp (unbiased,
    so updates far below a bf16 ulp still move the weights on average)."""
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device=x.device)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)   # low 16 bits zero: exact in bf16


def factored_rms(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` of a second moment ``v`` as a factored copy holds it (``--state-dtype int8-factored``): a matrix
    from its row and column means only, ``v_ij ~ r_i c_j / mean(r)`` (Adafactor's rank-one fit, exact where ``v`` is
    an outer product); anything else exactly."""
    if v.dim() != 2:
        return v.sqrt()
    r, c = v.mean(dim=1, keepdim=True), v.mean(dim=0, keepdim=True)
    return (r * c / r.mean().clamp_min(torch.finfo(v.dtype).tiny)).sqrt()


def cut_backward(model: torch.nn.Module, top_blocks: int) -> list[bool]:
    """Detach the input of the ``top_blocks``-th transformer block from the top (all of them: the embeddings'
    output) while the returned switch's one value is True, so a backward then reaches the top blocks, the final
    norm and the head only."""
    blocks = block_list(model)
    if blocks is None:
        raise ValueError("--top-blocks: this model has no list of transformer blocks to cut")
    if not 1 <= top_blocks <= len(blocks):
        raise ValueError(f"--top-blocks: 1 to {len(blocks)} for this model (got {top_blocks})")
    switch = [False]

    def detach_input(module, args, kwargs):
        if not switch[0]:
            return None
        if args:
            return (args[0].detach(),) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach()}

    blocks[len(blocks) - top_blocks].register_forward_pre_hook(detach_input, with_kwargs=True)
    return switch


def train(seed: int, lr: float, steps: int, mode: str | None, F: int = 1, H: int = 1, start: int = 50, *,
          state_dtype: str = "fp32", weights: str = "fp32", batch: int = 16, model_name: str = "gpt2-tiny",
          seq_len: int = 128, device: str = "cpu", bf16: bool = False, drift_beta: float = 0.95,
          top_blocks: int | None = None, lower: str = "still", cut_clip: str = "own",
          window: int | None = None, window_cover: str = "none", gradient_fraction: float = 1.0,
          gradient_lr_scale: float = 1.0, gradient_beta1: float | None = None, eval_every: int | None = None,
          eval_from: int = 0, predict_clip: str = "own", real_cover: str = "none") -> dict:
    """One run; ``mode=None`` is plain AdamW for ``steps`` real steps on its own schedule. ``weights``: what a
    gradient Predict step updates: ``fp32`` the weights exactly (a GPU holding the run's displacement in fp32),
    ``bf16-sr`` the 16-bit weights the GPU holds, rounded stochastically, the masters catching up at the next
    real step by the 16-bit weights' change over the run. ``window``, ``gradient_fraction``,
    ``gradient_lr_scale``, ``gradient_beta1``, ``eval_every``, ``eval_from``, ``predict_clip``, ``real_cover``: see
    the module docstring."""
    model, params, opt, stream, val_data = setup(seed, lr, batch, model_name, seq_len, device)
    vb = [{k: v.to(device) for k, v in b.items()} for b in val_batches(val_data, seq_len, 16, max_batches=16)]
    autocast = lambda: torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,  # noqa: E731
                                      enabled=bf16)
    lr_at = schedule(lr, steps)
    flat = lambda: torch.cat([p.detach().flatten() for p in params])  # noqa: E731
    held = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    compact = state_dtype in ("int8-factored", "int4-factored")   # m in 8- or 4-bit blocks, v factored (7B)
    rounding = torch.Generator(device=device).manual_seed(seed)
    if state_dtype == "int8-factored":
        m_int8 = [CompactBuffer(p.numel(), "int8", p.device) for p in params]
        hold = lambda i, m: held_int8(m_int8[i], m, rounding)  # noqa: E731
    else:
        hold = lambda i, m: held_int4(m, rounding)  # noqa: E731
    cut = cut_backward(model, top_blocks) if top_blocks is not None else [False]
    embedding = model.get_input_embeddings().weight

    # --eval-every: the validation loss along the run (the final one's batches; no dropout, no generator
    # touched, so the run is the same with or without it), with the steps of each kind taken so far
    curve: list[dict] = []
    eval_seconds = [0.0]

    def val_loss() -> float:
        with torch.no_grad(), autocast():
            return sum(float(model(**b).loss) for b in vb) / len(vb)

    def evaluate(done: int, real_n: int, predicted_n: int) -> None:
        if not eval_every or done < eval_from or done >= steps or done % eval_every:
            return
        t_eval = time.perf_counter()
        curve.append({"step": done, "real": real_n, "predicted": predicted_n, "val": val_loss()})
        eval_seconds[0] += time.perf_counter() - t_eval

    clip_coef = [1.0]   # the last real step's clipping factor
    share_coef = [None]   # --predict-clip previous: the factor that would have clipped the last Predict gradient
    # --predict-clip tensor: each parameter's share of the last gradient's norm (any step's, before clipping)
    norm_shares: list[list[float] | None] = [None]
    beta1 = BETAS[0] if gradient_beta1 is None else gradient_beta1   # the Predict steps' first-moment decay
    # The gradient noise scale from the share steps' norms and the real steps' (the engine's estimator,
    # ds_hybrid.noise_scale): the worth it projects for a share step, beside the worth measured here
    noise, taken_norm = NoiseScale(), [None, 0]

    def gradient(fraction: float = 1.0, clip: str = "own") -> float:
        # (a whole batch from the stream whatever share of it the step takes; the engine's rule cuts it)
        expected_sq = noise.expected_share_sq() if clip == "expected" else None   # (before this step's norm)
        (batch_in,) = batch_share([next(stream)], fraction)
        taken_norm[:] = [None, batch_samples([batch_in])]
        with autocast():
            loss = model(**batch_in).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        streamed = clip != "own"   # --predict-clip: a factor known before the backward
        if predict_clip in ("tensor", "tensor-v") and not cut[0]:
            norms = [float(p.grad.float().norm()) if p.grad is not None else 0.0 for p in params]
            total = sum(n * n for n in norms) ** 0.5
            shares_before, norm_shares[0] = norm_shares[0], [n / (total + 1e-12) for n in norms]
            if clip in ("tensor", "tensor-v"):   # (a real step comes before every Predict run: its shares are set)
                # each parameter clipped where the whole would have clipped it had its norm kept the last
                # gradient's proportions: known from its own gradient alone, as the backward produces it
                taken_norm[0] = total
                for p, n, share in zip(params, norms, shares_before):
                    if p.grad is not None:
                        p.grad.mul_(min(1.0, CLIP * share / (n + 1e-12)))
                return float(loss.detach())
        if (cut[0] and cut_clip == "last-real") or streamed:
            # a cut gradient's norm leaves out the blocks below, a streamed update cannot wait for the whole
            # norm: scaled by a factor from an earlier step instead
            grads = [p.grad for p in params if p.grad is not None]
            factor = clip_coef[0]
            if streamed:   # the norm is still known once the backward ends: the noise scale's, the next step's
                norm = float(torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt())
                taken_norm[0] = norm
                if clip == "previous":
                    factor = clip_coef[0] if share_coef[0] is None else share_coef[0]
                    share_coef[0] = min(1.0, CLIP / (norm + 1e-6))
                elif clip == "expected" and expected_sq is not None:
                    factor = min(1.0, CLIP / (expected_sq ** 0.5 + 1e-6))
            for g in grads:
                g.mul_(factor)
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(params, CLIP))
            if not cut[0]:
                clip_coef[0] = min(1.0, CLIP / (norm + 1e-6))
                taken_norm[0] = norm
        return float(loss.detach())

    prev = vel = None
    covered = None   # --real-cover: the weights and moments the GPU's step of the real step before a run left
    # --window: the last real step's update, its LR and the optimizer state before it; the update before, per unit LR
    last_update = last_lr = pre_state = unit_before = None
    t = real = predicted = since = 0
    t0 = time.perf_counter()
    while t < steps:
        if mode is not None and t >= start and since >= F:
            # A Predict run of H steps. The GPU's copy of the optimizer state, frozen at the last real step.
            behind = window is not None and pre_state is not None
            if behind:   # the state as the GPU copied it during the last real step's forward and backward
                k, m_src, v_src = pre_state
            elif covered is not None:   # --real-cover: the moments the GPU's own real step left (m already held)
                k, m_src, v_src = covered["k"], covered["m"], covered["v"]
            else:
                k = int(opt.state[params[0]]["step"])
                m_src = [opt.state[p]["exp_avg"] for p in params]
                v_src = [opt.state[p]["exp_avg_sq"] for p in params]
            if predict_clip == "tensor-v":   # the run's first shares: each parameter's of the norm v expects
                v_norms = [float(v.double().sum()) ** 0.5 for v in v_src]
                v_total = sum(x * x for x in v_norms) ** 0.5
                norm_shares[0] = [x / (v_total + 1e-12) for x in v_norms]
            rms = factored_rms if compact else torch.sqrt
            denom = [rms(v / (1 - BETAS[1] ** k)).to(held) for v in v_src]
            # clone: the optimizer's own m is touched only where adam-carry hands the run's m back
            m_loc = ([m.to(held).float().clone() for m in m_src]
                     if mode in ("adam-local", "adam-carry") else None)
            if compact and m_loc is not None and covered is None:   # the GPU's compact copy of the optimizer's m
                m_loc = [hold(i, m) for i, m in enumerate(m_loc)]
            taken = 0
            sixteen = weights == "bf16-sr" and mode in GRADIENT_MODES
            if sixteen:   # the GPU's 16-bit weights, which the Predict steps' forwards see
                start_masters = [p.detach().clone() for p in params]
                w16 = ([stochastic_bf16(w, rounding) for w in covered["weights"]] if covered is not None
                       else [p.detach().to(torch.bfloat16) for p in params])
                with torch.no_grad():
                    for p, w in zip(params, w16):
                        p.copy_(w.float())
            elif covered is not None:   # the weights the GPU's step left (the commit carries the difference)
                with torch.no_grad():
                    for p, w in zip(params, covered["weights"]):
                        p.copy_(w)
            covered = None
            for j in range(H):
                if t + j >= steps:
                    break
                step_lr = lr_at(t + j) * (gradient_lr_scale if mode in GRADIENT_MODES else 1.0)
                if mode in GRADIENT_MODES:
                    cut[0] = top_blocks is not None
                    stale = behind and j < window
                    if stale:   # the real step's update is still on the CPU: the GPU's weights lack it
                        now = [p.detach().clone() for p in params]
                        with torch.no_grad():
                            for i, p in enumerate(params):
                                p.sub_(last_update[i])
                                if window_cover == "last" and unit_before is not None:
                                    p.add_(unit_before[i], alpha=last_lr)
                    try:
                        gradient(gradient_fraction, clip=predict_clip)
                        if taken_norm[0] is not None and not stale:
                            noise.observe(taken_norm[0] ** 2, taken_norm[1], False, t + j)
                    finally:
                        cut[0] = False
                        if stale:
                            with torch.no_grad():
                                for p, w in zip(params, now):
                                    p.copy_(w)
                with torch.no_grad():
                    if mode == "drift" and vel is not None:
                        add_flat(params, vel, step_lr)
                    elif mode in GRADIENT_MODES:
                        for i, p in enumerate(params):
                            if lower == "still-embedding" and top_blocks is not None and p is embedding:
                                continue   # the tied token embedding is held with what lies below the cut
                            if p.grad is None and (lower.startswith("still") or mode == "rms"):
                                continue   # below the cut (--top-blocks): no gradient, no move
                            if mode == "rms":
                                d = p.grad
                            else:
                                g = p.grad if p.grad is not None else torch.zeros_like(p)   # (--lower coast)
                                m_loc[i] = m_loc[i].mul_(beta1).add_(g, alpha=1 - beta1).to(held).float()
                                if compact:   # stored in 8 or 4 bits after every update, and used as stored
                                    m_loc[i] = hold(i, m_loc[i])
                                d = m_loc[i] / (1 - BETAS[0] ** (k + j + 1))
                            p.mul_(1 - step_lr * WEIGHT_DECAY).addcdiv_(d, denom[i].float() + EPS, value=-step_lr)
                            if sixteen:
                                w16[i] = stochastic_bf16(p.detach(), rounding)
                                p.copy_(w16[i].float())
                predicted += 1
                taken += 1
                evaluate(t + j + 1, real, predicted)
            if mode == "adam-carry":
                for i, (p, m) in enumerate(zip(params, m_loc)):
                    if behind:   # the run's gradients on top of the real step's m, not the m before it
                        m = rebased_first_moment(m, pre_state[1][i], opt.state[p]["exp_avg"], taken)
                    opt.state[p]["exp_avg"].copy_(m)
            if sixteen:   # the masters catch up by what the 16-bit weights moved
                with torch.no_grad():
                    for p, m0, w in zip(params, start_masters, w16):
                        p.copy_(m0 + (w.float() - m0.to(torch.bfloat16).float()))
            t, since = t + H, 0
            opt.zero_grad(set_to_none=True)
            if mode == "drift":
                prev = flat()   # the drift velocity folds real updates only
            continue
        for g in opt.param_groups:
            g["lr"] = lr_at(t)
        # --real-cover: a run follows this step (its optimizer state exists: not the first step)
        cover = real_cover != "none" and mode is not None and t + 1 >= start and since + 1 >= F and t > 0
        if cover:
            cover_before = [p.detach().clone() for p in params]
            cover_m = [opt.state[p]["exp_avg"].clone() for p in params]
        gradient()
        if taken_norm[0] is not None:
            noise.observe(taken_norm[0] ** 2, taken_norm[1], True, t)
        if window is not None:
            before = [p.detach().clone() for p in params]
            if opt.state[params[0]]:
                pre_state = (int(opt.state[params[0]]["step"]),
                             [opt.state[p]["exp_avg"].clone() for p in params],
                             [opt.state[p]["exp_avg_sq"].clone() for p in params])
            else:
                pre_state = None   # (the first step: no state to copy yet)
            if window_cover == "last" and last_update is not None and last_lr > 0:
                unit_before = [u / last_lr for u in last_update]
        opt.step()
        if window is not None:
            last_update, last_lr = [p.detach() - b for p, b in zip(params, before)], lr_at(t)
        if cover:
            covered = cover_step(params, cover_before, cover_m, [opt.state[p]["exp_avg_sq"] for p in params],
                                 int(opt.state[params[0]]["step"]), lr_at(t), hold)
        if mode == "drift":
            w = flat()
            vel, prev = fold_velocity(vel, w, prev, lr_at(t), drift_beta), w
        t, real, since = t + 1, real + 1, since + 1
        evaluate(t, real, predicted)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0 - eval_seconds[0]
    val = val_loss()
    return {"seed": seed, "lr": lr, "steps": steps, "mode": mode or "plain", "F": F if mode else 0,
            "H": H if mode else 0, "start": start,
            "real_steps": real, "predicted_steps": predicted, "state_dtype": state_dtype, "weights": weights,
            "top_blocks": top_blocks, "lower": lower if top_blocks is not None else None,
            "cut_clip": cut_clip if top_blocks is not None else None,
            "window": window, "window_cover": window_cover if window is not None else None,
            "gradient_fraction": gradient_fraction if mode in GRADIENT_MODES else 1.0,
            "gradient_lr_scale": gradient_lr_scale if mode in GRADIENT_MODES else 1.0,
            "gradient_beta1": gradient_beta1 if mode in ("adam-local", "adam-carry") else None,
            "predict_clip": predict_clip if mode in GRADIENT_MODES else "own",
            "real_cover": real_cover if mode is not None else "none",
            "val_loss": val,
            "noise_scale": noise.summary() if mode in GRADIENT_MODES and gradient_fraction < 1.0 else None,
            "curve": curve if eval_every else None, "train_seconds": seconds}


@torch.no_grad()
def cover_step(params: list, before: list, m_pre: list, v_post: list, k: int, lr: float, hold) -> dict:
    """``--real-cover compact``: the real step as the engine's cover takes it in the compact state (the module
    docstring). ``params``' ``.grad`` is the step's gradient, clipped by the whole norm; ``m_pre`` the optimizer's
    first moment before the step, ``v_post`` its second after it (``beta2 v + (1 - beta2) g^2``: the cover's update
    of the factored means is that one's); ``k`` the step count after it. Returns the weights it moves ``before`` to
    and the run's moments (``m`` held as the state holds it).
    """
    weights, ms, vs = [], [], []
    for i, p in enumerate(params):
        m = hold(i, m_pre[i] * BETAS[0] + (1 - BETAS[0]) * p.grad.float())
        v = v_post[i].clone()
        denom = factored_rms(v / (1 - BETAS[1] ** k)) + EPS
        weights.append(before[i] * (1 - lr * WEIGHT_DECAY) - lr * (m / (1 - BETAS[0] ** k)) / denom)
        ms.append(m), vs.append(v)
    return {"k": k, "m": ms, "v": vs, "weights": weights}


def held_int8(buf: CompactBuffer, m: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``m`` stored in the int8 buffer ``buf`` (stochastic rounding) and read back: the value the run then holds."""
    buf.store(m.detach().flatten().float(), generator=generator)
    return buf.load().view_as(m)


def held_int4(m: torch.Tensor, generator: torch.Generator, block: int = 256) -> torch.Tensor:
    """``m`` as 4 bits a value would hold it (``--state-dtype int4-factored``): blocks of ``block`` values, each an
    absmax / 7 scale and values in -7..7 rounded stochastically (unbiased), read back as fp32. The study's own
    quantizer: the package stores no 4-bit buffer; this prices what one would cost in loss."""
    flat = m.detach().flatten().float()
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % block)).view(-1, block)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 7.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    noise = torch.rand(blocks.shape, generator=generator, device=blocks.device)
    q = (blocks / safe + noise).floor_().clamp_(-7, 7)
    return (q * scale).flatten()[:n].view_as(m)


def steps_worth(val: float, curve: list[tuple[int, float]]) -> tuple[float | None, str]:
    """Plain AdamW steps a validation loss is worth on ``curve`` ((steps, val) of plain runs, each on its own
    schedule), linear between neighbours; ``(None, "below")`` when worse than the shortest plain run,
    ``(None, "above")`` when better than the longest."""
    pts = sorted(curve)
    if val > pts[0][1]:
        return None, "below"
    for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
        if min(v0, v1) <= val <= max(v0, v1):
            return (float(n0) if v0 == v1 else n0 + (n1 - n0) * (v0 - val) / (v0 - v1)), ""
    return None, "above"


def first_reach(points: list[tuple[float, float, float]], target: float) -> tuple[float, float] | None:
    """Where a run's validation loss first reaches ``target``: ``points`` are (step, cost, val) in step order
    (its curve, then its final loss). The step and the cost there, linear between the point before and the
    first at or below the target (the first point itself where it is the first); None where none is."""
    if points and points[0][2] <= target:
        return points[0][0], points[0][1]
    step = crossing([(s, v) for s, _, v in points], target)   # (the bench's rule; linear, so both alike)
    return None if step is None else (step, crossing([(c, v) for _, c, v in points], target))


def run_points(row: dict, real_cost: float = 1.0, predict_cost: float = 0.0) -> list[tuple[float, float, float]]:
    """(step, cost, val) along a run: its curve (``--eval-every``; none for a run without one) and its final
    loss, a real step costing ``real_cost`` and a Predict step ``predict_cost``, in plain steps."""
    pts = [(p["step"], p["real"] * real_cost + p["predicted"] * predict_cost, p["val"])
           for p in row.get("curve") or []]
    pts.append((row["steps"], row["real_steps"] * real_cost + row["predicted_steps"] * predict_cost,
                row["val_loss"]))
    return pts


def time_to_target(rows: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """``--target-steps N``: per (schedule, mode), the time each seed's hybrid run takes to reach plain AdamW's
    final loss after N steps, over plain's own shortest time to it: the bench's budget-frontier rule, where
    every run of a system counts (plain's longer schedules too: one may cross that loss before step N) and a
    run's time to a loss is where its curve first reaches it. Plain's time is in its steps; the hybrid's is
    ``real_cost x`` its real steps plus ``c x`` its Predict steps at that point, for each ``--predict-cost c``
    (arithmetic on timers measured elsewhere, as the worth columns' costs are)."""
    target_of = {r["seed"]: r["val_loss"] for r in rows if r["mode"] == "plain" and r["steps"] == args.target_steps}
    costs = args.predict_cost or []
    out, lines = [], []
    if not target_of:
        return out, lines
    plain_time = {}
    for seed, target in target_of.items():
        reached = [first_reach(run_points(r), target) for r in rows if r["mode"] == "plain" and r["seed"] == seed]
        plain_time[seed] = min((x[1] for x in reached if x is not None), default=None)
    lines = [f"| schedule (real : Predict) | mode | seeds reaching plain's final loss at {args.target_steps} steps | "
             "plain steps to it (its shortest over its runs) | hybrid steps to it (real / Predict) | "
             + " | ".join(f"time over plain's (c = {c:g}, r = {args.real_cost:g})" for c in costs) + " |",
             "|---|---|---|---|---|" + "---|" * len(costs)]
    for F, H in args.schedules:
        for mode in args.modes:
            rs = [r for r in rows if r["mode"] == mode and (r["F"], r["H"]) == (F, H) and r["seed"] in target_of]
            if not rs:
                continue
            per_seed = []
            for r in rs:
                target = target_of[r["seed"]]
                at = first_reach(run_points(r, 1.0, 0.0), target)   # (step, real steps)
                rec = {"seed": r["seed"], "target": target, "plain_steps": plain_time[r["seed"]],
                       "plain_runs_curved": sum(1 for q in rows if q["mode"] == "plain" and q["seed"] == r["seed"]
                                                and q.get("curve")),
                       "curved": bool(r.get("curve")), "step": None, "real": None, "predicted": None, "ratio": {}}
                if at is not None:
                    step, real = at
                    rec.update(step=step, real=real, predicted=step - real)
                    for c in costs:
                        _, cost = first_reach(run_points(r, args.real_cost, c), target)
                        rec["ratio"][f"{c:g}"] = cost / plain_time[r["seed"]]
                per_seed.append(rec)
            hit = [x for x in per_seed if x["step"] is not None]
            agg = {"F": F, "H": H, "mode": mode, "target_steps": args.target_steps, "real_cost": args.real_cost,
                   "seeds": per_seed, "reached": len(hit), "runs": len(per_seed)}
            plain_ms = _mean_sd([x["plain_steps"] for x in per_seed if x["plain_steps"] is not None] or [float("nan")])
            cells = [f"{F} : {H}", mode, f"{len(hit)} of {len(per_seed)}", f"{plain_ms[0]:.0f} ± {plain_ms[1]:.0f}"]
            if hit:
                re_, pr_ = _mean_sd([x["real"] for x in hit]), _mean_sd([x["predicted"] for x in hit])
                cells.append(f"{re_[0]:.0f} ± {re_[1]:.0f} / {pr_[0]:.0f} ± {pr_[1]:.0f}")
                for c in costs:
                    m, sd = _mean_sd([x["ratio"][f"{c:g}"] for x in hit])
                    agg[f"ratio_c{c:g}"], agg[f"ratio_c{c:g}_sd"] = m, sd
                    cells.append(f"{m:.2f} ± {sd:.2f}x" + ("" if len(hit) == len(per_seed) else " (seeds reaching it)"))
            else:
                cells += ["not reached"] + ["-"] * len(costs)
            out.append(agg)
            lines.append("| " + " | ".join(cells) + " |")
    return out, lines


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def report(args: argparse.Namespace, argv: list[str] | None, rows: list[dict], seconds: float,
           complete: bool) -> dict:
    """Per (schedule, mode): val loss, plain steps it is worth, step worth, and the Predict-step costs at which
    the hybrid breaks even with plain AdamW and reaches 0.6x its steps. Seeds without every plain run are left
    out of the worth columns."""
    curves: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r["mode"] == "plain":
            curves.setdefault(r["seed"], []).append((r["steps"], r["val_loss"]))
    plain_full = {r["seed"]: r["val_loss"] for r in rows if r["mode"] == "plain" and r["steps"] == args.steps}
    lines = ["| schedule (real : Predict) | mode | Predict share | val loss (mean ± sd) | gap to plain, all real | "
             "plain steps it is worth | step worth (mean ± sd) | worth the noise scale projects | "
             "cost c for break-even | cost c for 0.6x |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    summary = []
    for F, H in args.schedules:
        for mode in args.modes:
            rs = [r for r in rows if r["mode"] == mode and (r["F"], r["H"]) == (F, H)]
            if not rs:
                continue
            per_seed = []
            for r in rs:
                n_eq, bound = steps_worth(r["val_loss"], curves.get(r["seed"], [(0, float("inf"))]))
                r["plain_steps_worth"], r["bound"] = n_eq, bound
                if n_eq is not None:
                    r["step_worth"] = (n_eq - r["real_steps"]) / r["predicted_steps"]
                    # hybrid steps, in plain steps, over n_eq: 1 at break-even, 0.6 at the goal
                    r["cost_break_even"] = (n_eq - r["real_steps"]) / r["predicted_steps"]
                    r["cost_for_0.6x"] = (0.6 * n_eq - r["real_steps"]) / r["predicted_steps"]
                    per_seed.append(r)
            val, val_sd = _mean_sd([r["val_loss"] for r in rs])
            gap = [r["val_loss"] - plain_full[r["seed"]] for r in rs if r["seed"] in plain_full]
            agg = {"F": F, "H": H, "mode": mode, "runs": len(rs), "seeds": [r["seed"] for r in rs],
                   "predicted_share": rs[0]["predicted_steps"] / rs[0]["steps"], "val": val, "val_sd": val_sd,
                   "gap_to_plain_full": statistics.mean(gap) if gap else None,
                   "bounds": [r["bound"] for r in rs if r["bound"]]}
            for key in ("plain_steps_worth", "step_worth", "cost_for_0.6x"):
                xs = [r[key] for r in per_seed]
                agg[key], agg[key + "_sd"] = _mean_sd(xs) if xs else (None, None)
            # the worth the gradient noise scale projects for a share step (each run's estimate over all its pairs)
            xs = [r["noise_scale"]["run_share_worth"] for r in rs
                  if (r.get("noise_scale") or {}).get("run_share_worth") is not None]
            agg["projected_worth"], agg["projected_worth_sd"] = _mean_sd(xs) if xs else (None, None)
            xs = [r["noise_scale"]["run_b_noise_samples"] for r in rs
                  if (r.get("noise_scale") or {}).get("run_b_noise_samples") is not None]
            agg["b_noise"], agg["b_noise_sd"] = _mean_sd(xs) if xs else (None, None)
            summary.append(agg)
            cell = lambda k, f: "-" if agg[k] is None else f"{agg[k]:{f}} ± {agg[k + '_sd']:{f}}"  # noqa: E731
            bound = (f" ({len(agg['bounds'])} of {len(rs)} outside the plain curve: "
                     f"{', '.join(sorted(set(agg['bounds'])))})" if agg["bounds"] else "")
            lines.append(f"| {F} : {H} | {mode} | {agg['predicted_share']:.0%} | {val:.4f} ± {val_sd:.4f} | "
                         + ("-" if agg["gap_to_plain_full"] is None else f"{agg['gap_to_plain_full']:+.4f}")
                         + f" | {cell('plain_steps_worth', '.0f')}{bound} | {cell('step_worth', '.2f')} | "
                         + (f"{cell('projected_worth', '.2f')} (B_noise {agg['b_noise']:.1f})"
                            if agg["projected_worth"] is not None and agg["b_noise"] is not None
                            else cell("projected_worth", ".2f")) + " | "
                         + ("-" if agg["step_worth"] is None else f"below {agg['step_worth']:.2f}")
                         + " | " + ("-" if agg["cost_for_0.6x"] is None else
                                    ("unreachable" if agg["cost_for_0.6x"] <= 0 else
                                     f"below {agg['cost_for_0.6x']:.2f}")) + " |")
    plain_lines = ["| plain AdamW steps | val loss (mean ± sd) |", "|---|---|"]
    for n in sorted({r["steps"] for r in rows if r["mode"] == "plain"}):
        v, sd = _mean_sd([r["val_loss"] for r in rows if r["mode"] == "plain" and r["steps"] == n])
        plain_lines.append(f"| {n} | {v:.4f} ± {sd:.4f} |")
    frontier, frontier_lines = time_to_target(rows, args) if args.target_steps else ([], [])
    return {"command": "benchmarks/grad_step_study.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M"), "seconds": round(seconds, 1), "complete": complete,
            "setup": {"model": args.model, "batch": f"{args.batch} x {args.seq_len}", "steps": args.steps,
                      "lr": args.lr, "start": args.start, "state_dtype": args.state_dtype, "weights": args.weights,
                      "top_blocks": args.top_blocks, "lower": args.lower, "cut_clip": args.cut_clip,
                      "window": args.window, "window_cover": args.window_cover,
                      "gradient_fraction": args.gradient_fraction,
                      "gradient_lr_scale": args.gradient_lr_scale, "gradient_beta1": args.gradient_beta1,
                      "predict_clip": args.predict_clip, "real_cover": args.real_cover, "device": args.device,
                      "bf16": args.bf16, "jobs": args.jobs, "threads": args.threads,
                      "eval_every": args.eval_every, "eval_from": args.eval_from, "target_steps": args.target_steps,
                      "real_cost": args.real_cost, "predict_cost": args.predict_cost},
            "rows": rows, "summary": summary, "table_markdown": "\n".join(lines),
            "plain_markdown": "\n".join(plain_lines),
            "time_to_target": frontier, "time_to_target_markdown": "\n".join(frontier_lines)}


def _init(threads: int) -> None:
    torch.set_num_threads(threads)


def _run(job: tuple) -> dict:
    args, kw = job
    return train(*args, **kw)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lr", type=float, default=2e-3, help="peak LR (2e-3: plain AdamW's swept best on the preset)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=600, help="schedule length of the hybrid runs")
    p.add_argument("--schedules", nargs="+", default=["1:1", "1:3"],
                   help="F:H, real steps then Predict steps per cycle")
    p.add_argument("--start", type=int, default=50, help="first step of a Predict run")
    p.add_argument("--modes", nargs="*", default=["skip", "drift", "adam-local", "adam-carry"], choices=MODES,
                   help="rms: the gradient over the frozen sqrt(v_hat), no first moment; none: plain runs only")
    p.add_argument("--plain-steps", type=float, nargs="*", default=[0.75, 1.0],
                   help="plain run lengths besides the hybrids' real-step counts, as fractions of --steps")
    p.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8-factored", "int4-factored"],
                   help="precision of the frozen optimizer state the Predict steps use (int8-factored: m in int8 "
                        "blocks, v of a matrix from its row and column means; int4-factored: m in 4-bit blocks)")
    p.add_argument("--predict-clip", default="own",
                   choices=["own", "last-real", "previous", "expected", "tensor", "tensor-v"],
                   help="a gradient Predict step's gradient clipped by its own norm, or scaled by the factor that "
                        "clipped the last real step's, or that would have clipped the previous Predict step's, or "
                        "the norm the noise scale expects, or each parameter to its share of the last gradient's "
                        "norm (an update streamed through the backward cannot wait for the whole norm; tensor-v: "
                        "a run's first shares from the second moment, as the engine's compact state takes them)")
    p.add_argument("--weights", default="fp32", choices=["fp32", "bf16-sr"],
                   help="what a gradient Predict step updates: the weights exactly (fp32 displacement on the GPU), "
                        "or 16-bit weights with stochastic rounding, the masters catching up by their change")
    p.add_argument("--top-blocks", type=int, default=None,
                   help="gradient Predict steps back-propagate through the top K transformer blocks only")
    p.add_argument("--lower", default="still", choices=["still", "still-embedding", "coast"],
                   help="with --top-blocks, what lies below the cut does in a Predict step: nothing, nothing and "
                        "the token embedding (tied to the head) held too, or Adam's step from its first moment "
                        "decayed as by a zero gradient")
    p.add_argument("--cut-clip", default="own", choices=["own", "last-real"],
                   help="with --top-blocks, a cut gradient clipped by its own norm (which leaves out the blocks "
                        "below), or scaled by the factor that clipped the last real step's gradient")
    p.add_argument("--window", type=int, default=None, metavar="N",
                   help="each real step's CPU Adam step runs behind the Predict run after it: the run's first N "
                        "steps take their gradients without its update, the run holds the moments from before it "
                        "(0: the moments alone)")
    p.add_argument("--window-cover", default="none", choices=["none", "last"],
                   help="with --window, the weights those N steps see moved by the update before, as a guess")
    p.add_argument("--real-cover", default="none", choices=["none", "compact"],
                   help="compact: the real step between two runs taken by the GPU in the run's compact state "
                        "while the optimizer's exact step runs behind (the module docstring)")
    p.add_argument("--gradient-fraction", type=float, default=1.0, metavar="F",
                   help="gradient Predict steps take their gradient from the first round(F x --batch) sequences of "
                        "their batch (0 < F <= 1)")
    p.add_argument("--gradient-lr-scale", type=float, default=1.0, metavar="S",
                   help="gradient Predict steps take S times the schedule's LR (and its weight decay)")
    p.add_argument("--gradient-beta1", type=float, default=None, metavar="B",
                   help="adam-local/adam-carry: the Predict steps' first moment decays by B (default: AdamW's 0.9)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="the runs this invocation trains (not those taken from --reuse) record their validation "
                        "loss every N steps (from --eval-from on)")
    p.add_argument("--eval-from", type=int, default=0, metavar="S", help="with --eval-every, the first step to record")
    p.add_argument("--target-steps", type=int, default=None, metavar="N",
                   help="report each hybrid's time to plain AdamW's final loss after N steps (a plain run of N "
                        "steps must be among the runs) over plain's shortest time to it over all its runs")
    p.add_argument("--predict-cost", type=float, nargs="+", default=None, metavar="C",
                   help="with --target-steps, a Predict step's cost in plain steps (one column each)")
    p.add_argument("--real-cost", type=float, default=1.0, metavar="R",
                   help="with --target-steps, a hybrid real step's cost in plain steps")
    p.add_argument("--model", default="gpt2-tiny", help="a name from ds_hybrid.models (vocabulary 256)")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--device", default="cpu", help="cpu, or cuda")
    p.add_argument("--bf16", action="store_true", help="forward and backward under bf16 autocast (fp32 masters)")
    p.add_argument("--jobs", type=int, default=2, help="runs at once, each in its own process")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per run")
    p.add_argument("--json", default=None, help="written after every run, so a study cut short keeps what it did")
    p.add_argument("--reuse", nargs="+", default=[], metavar="JSON",
                   help="JSONs of this study with the same model, shape, LR and device: their runs are taken "
                        "instead of run again (plain AdamW runs do not depend on the Predict settings), so a study "
                        "can be extended by schedules, modes or plain lengths, or resumed")
    args = p.parse_args(argv)
    try:
        args.schedules = [tuple(int(x) for x in s.split(":")) for s in args.schedules]
    except ValueError:
        p.error(f"--schedules: F:H pairs of integers, e.g. 1:3 (got {args.schedules})")
    if any(F < 1 or H < 1 for F, H in args.schedules) or args.steps <= args.start:
        p.error("--schedules: F and H at least 1; --steps above --start")
    if args.top_blocks is None and (args.lower, args.cut_clip) != ("still", "own"):
        p.error("--lower and --cut-clip say what a cut backward does: give --top-blocks too")
    if args.top_blocks is not None and args.predict_clip != "own":
        p.error("--predict-clip with --top-blocks: --cut-clip says how a cut gradient is scaled")
    if args.predict_clip != "own" and not set(args.modes) <= set(GRADIENT_MODES):
        p.error(f"--predict-clip: the Predict steps must take a gradient, --modes among "
                f"{', '.join(GRADIENT_MODES)} (got {' '.join(args.modes)})")
    if not 0.0 < args.gradient_fraction <= 1.0:
        p.error(f"--gradient-fraction: above 0 and at most 1 (got {args.gradient_fraction})")
    if args.gradient_fraction < 1.0 and not set(args.modes) <= set(GRADIENT_MODES):
        p.error(f"--gradient-fraction: the Predict steps must take a gradient, --modes among "
                f"{', '.join(GRADIENT_MODES)} (got {' '.join(args.modes)})")
    if args.gradient_lr_scale <= 0.0:
        p.error(f"--gradient-lr-scale: above 0 (got {args.gradient_lr_scale})")
    if args.gradient_lr_scale != 1.0 and not set(args.modes) <= set(GRADIENT_MODES):
        p.error(f"--gradient-lr-scale: the Predict steps must take a gradient, --modes among "
                f"{', '.join(GRADIENT_MODES)} (got {' '.join(args.modes)})")
    if args.gradient_beta1 is not None:
        if not 0.0 <= args.gradient_beta1 < 1.0:
            p.error(f"--gradient-beta1: from 0 to below 1 (got {args.gradient_beta1})")
        if not set(args.modes) <= {"adam-local", "adam-carry"}:
            p.error(f"--gradient-beta1: the Predict steps must keep a first moment, --modes among adam-local, "
                    f"adam-carry (got {' '.join(args.modes)})")
        if args.window is not None:
            p.error("--gradient-beta1 and --window: one at a time (the window rebases the moment by AdamW's beta1)")
    if args.window is None and args.window_cover != "none":
        p.error("--window-cover says what the steps in the CPU window see: give --window too")
    if args.window is not None:
        if args.window < 0:
            p.error(f"--window: 0 or more Predict steps (got {args.window})")
        if args.top_blocks is not None:
            p.error("--window and --top-blocks: one at a time")
        if not set(args.modes) <= set(GRADIENT_MODES):
            p.error(f"--window: the Predict steps must take a gradient, --modes among {', '.join(GRADIENT_MODES)} "
                    f"(got {' '.join(args.modes)})")
    if args.real_cover != "none":
        if not set(args.modes) <= {"adam-local", "adam-carry"} or args.state_dtype not in ("int8-factored",
                                                                                         "int4-factored"):
            p.error("--real-cover compact: --modes among adam-local, adam-carry with --state-dtype int8-factored or "
                    "int4-factored (the cover builds the run's compact state)")
        if args.window is not None or args.top_blocks is not None:
            p.error("--real-cover with --window or --top-blocks: one at a time")
    if args.top_blocks is not None:
        try:   # (here, not in a worker process: the model's block count from a copy of it)
            cut_backward(build_model(args.model, vocab_size=256, seq_len=args.seq_len), args.top_blocks)
        except ValueError as e:
            p.error(f"{e} (--model {args.model})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA device here")
    if args.eval_every is not None and args.eval_every < 1:
        p.error(f"--eval-every: at least 1 step (got {args.eval_every})")
    if args.eval_from and args.eval_every is None:
        p.error("--eval-from says where the curve starts: give --eval-every too")
    if (args.predict_cost or args.real_cost != 1.0) and args.target_steps is None:
        p.error("--predict-cost and --real-cost price the time to a target: give --target-steps too")
    if args.predict_cost and min(args.predict_cost) < 0 or args.real_cost <= 0:
        p.error(f"--predict-cost: 0 or more, --real-cost: above 0 (got {args.predict_cost}, {args.real_cost})")
    if args.target_steps is not None and not any(round(f * args.steps) == args.target_steps for f in args.plain_steps):
        p.error(f"--target-steps {args.target_steps}: no plain run of that length among --plain-steps "
                f"{' '.join(map(str, args.plain_steps))} (fractions of --steps {args.steps})")
    shape = dict(batch=args.batch, model_name=args.model, seq_len=args.seq_len, device=args.device, bf16=args.bf16,
                 eval_every=args.eval_every, eval_from=args.eval_from)
    lengths = sorted({real_steps(args.steps, F, H, args.start) for F, H in args.schedules}
                     | {round(f * args.steps) for f in args.plain_steps})
    want = {"model": args.model, "batch": f"{args.batch} x {args.seq_len}", "lr": args.lr, "bf16": args.bf16,
            "device": args.device}
    prior: dict[tuple, dict] = {}
    for path in args.reuse:
        try:
            saved = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            p.error(f"--reuse {path}: {e}")
        if any(saved.get("setup", {}).get(k) != v for k, v in want.items()):
            p.error(f"--reuse {path}: its setup {saved.get('setup')} differs from this study's {want}")
        prior.update({run_key(r): r for r in saved["rows"]})
    jobs, reused = [], []
    for seed in args.seeds:
        wanted = [((seed, args.lr, n, None), shape) for n in lengths]
        wanted += [((seed, args.lr, args.steps, mode, F, H, args.start),
                    {**shape, "state_dtype": args.state_dtype, "weights": args.weights,
                     "top_blocks": args.top_blocks, "lower": args.lower, "cut_clip": args.cut_clip,
                     "window": args.window, "window_cover": args.window_cover,
                     "gradient_fraction": args.gradient_fraction,
                     "gradient_lr_scale": args.gradient_lr_scale, "gradient_beta1": args.gradient_beta1,
                     "predict_clip": args.predict_clip, "real_cover": args.real_cover})
                   for F, H in args.schedules for mode in args.modes]
        for job in wanted:
            key = job_key(*job)
            if key in prior:
                reused.append(prior.pop(key))
            else:
                jobs.append(job)
    t0 = time.time()
    rows: list[dict] = list(reused)

    def done(row: dict) -> None:
        rows.append(row)
        print(f"seed {row['seed']} {row['mode']}" + (f" {row['F']}:{row['H']}" if row["H"] else "")
              + f" {row['steps']} steps "
              f"({row['real_steps']} real): val {row['val_loss']:.4f} ({row['train_seconds']:.0f} s)", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report(args, argv, rows, time.time() - t0, False), indent=2))

    if args.jobs > 1 and not args.device.startswith("cuda"):
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.jobs, initializer=_init, initargs=(args.threads,)) as pool:
            for row in pool.imap_unordered(_run, jobs):
                done(row)
    else:
        _init(args.threads)
        for job in jobs:
            done(_run(job))
    result = report(args, argv, rows, time.time() - t0, complete=True)
    print(result["plain_markdown"])
    print(result["table_markdown"])
    if result["time_to_target_markdown"]:
        print(result["time_to_target_markdown"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
