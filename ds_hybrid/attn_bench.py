"""``ds-hybrid attn-bench``: fused (SDPA) against eager attention, by sequence length.

    ds-hybrid attn-bench [--models gpt2-tiny,llama-tiny] [--seq-lens 64,128,256,512,1024]
                         [--batch 4] [--repeat 3] [--device auto|cpu|cuda] [--threads N] [--json PATH]

For each model and sequence length, the same randomly initialised model (one seed) is built
with ``attention="sdpa"`` and ``attention="eager"`` (``models.build_model``) and one training
step's forward + backward is timed (median of ``--repeat``, after a warm-up step). Memory:

* **activation MB**: the bytes of the tensors autograd saves for the backward pass (unique
  storages, parameters excluded), counted with ``torch.autograd.graph.saved_tensors_hooks``.
  Exact and device-independent: it is what attention's fused kernels save (no T x T matrix).
* **peak MB** (CUDA only): ``torch.cuda.max_memory_allocated`` during the step, minus the memory
  allocated before it.

It also records which attention kernel ran (``aten`` op names from one profiled step) and the
loss difference between the two paths (same weights and batch). Writes
runs/attn-bench/attention-{cpu,cuda}.json by default; the tables in docs/kernels.md come from
``--json docs/results/attention-{cpu,cuda}.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from .arguments import HelpFormatter
from .models import attention_dropout, build_model, count_parameters, model_config

# --json's folder when none is given: the repository's docs/results/ are written only when --json names them.
DEFAULT_DIR = Path("runs/attn-bench")

_ATTN_OPS = ("flash", "efficient", "cudnn", "_scaled_dot_product_attention_math", "bmm", "baddbmm")


class SavedTensorBytes:
    """Bytes of the storages autograd saves for backward inside the block, parameters excluded."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.exclude and ptr not in self.seen:
            self.seen[ptr] = st.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def attention_ops(model, batch: dict, device: torch.device) -> list[str]:
    """The attention-related aten ops one forward + backward runs."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        model(**batch).loss.backward()
        _sync(device)
    model.zero_grad(set_to_none=True)
    keys = {e.key for e in prof.key_averages()}
    return sorted(k for k in keys if k.startswith("aten::") and any(s in k for s in _ATTN_OPS)
                  and ("attention" in k or k in ("aten::bmm", "aten::baddbmm")))


def measure(name: str, impl: str, seq: int, batch_size: int, repeat: int, device: torch.device,
            seed: int = 0, profile_ops: bool = False) -> dict:
    torch.manual_seed(seed)
    model = build_model(name, vocab_size=256, seq_len=seq, attention=impl).to(device)
    model.train()
    gen = torch.Generator().manual_seed(seed + seq)
    ids = torch.randint(0, 256, (batch_size, seq), generator=gen).to(device)
    batch = {"input_ids": ids, "labels": ids}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def step(counter: SavedTensorBytes | None = None) -> float:
        if counter is None:
            loss = model(**batch).loss
        else:
            with counter.hooks():
                loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss.detach())

    loss = step()                                      # warm-up (and the loss to compare)
    counter = SavedTensorBytes(params)
    step(counter)
    peak_mb = None
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        _sync(device)
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"model": name, "attention": impl, "seq_len": seq, "batch": batch_size,
            "step_ms": statistics.median(times) * 1e3, "activation_mb": counter.nbytes / 2 ** 20,
            "peak_mb": peak_mb, "loss": loss, "parameters": count_parameters(model),
            "attn_dropout": attention_dropout(model.config),
            "kernels": attention_ops(model, batch, device) if profile_ops else None}


def format_table(rows: list[dict], device_name: str) -> str:
    cuda = any(r["peak_mb"] is not None for r in rows)
    out = [f"device: {device_name}", "",
           "| model | seq | sdpa ms | eager ms | eager/sdpa time | sdpa act MB | eager act MB | eager/sdpa act |"
           + (" sdpa peak MB | eager peak MB |" if cuda else "") + " loss diff |",
           "|---|---|---|---|---|---|---|---|" + ("---|---|" if cuda else "") + "---|"]
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["seq_len"]), {})[r["attention"]] = r
    for (model, seq), p in pairs.items():
        s, e = p["sdpa"], p["eager"]
        line = (f"| {model} | {seq} | {s['step_ms']:.1f} | {e['step_ms']:.1f} | {e['step_ms'] / s['step_ms']:.2f}x | "
                f"{s['activation_mb']:.1f} | {e['activation_mb']:.1f} | {e['activation_mb'] / s['activation_mb']:.2f}x |")
        if cuda:
            line += f" {s['peak_mb']:.1f} | {e['peak_mb']:.1f} |"
        out.append(line + f" {abs(s['loss'] - e['loss']):.1e} |")
    kernels = {(r["model"], r["attention"]): r["kernels"] for r in rows if r["kernels"] is not None}
    out.append("")
    for (model, impl), ops in kernels.items():
        out.append(f"{model} {impl}: {', '.join(ops) or '-'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ds-hybrid attn-bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--models", default="gpt2-tiny", help="comma-separated model names")
    ap.add_argument("--seq-lens", default="64,128,256,512,1024", help="comma-separated sequence lengths")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--repeat", type=int, default=3, help="timed steps per point (the median is reported)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 gives stable times on a shared machine)")
    ap.add_argument("--json", type=Path, metavar="PATH",
                    help=f"the result file (default: {DEFAULT_DIR}/attention-cpu.json or attention-cuda.json)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("ds-hybrid attn-bench: --device cuda but torch sees no CUDA device")
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    device_name = (torch.cuda.get_device_name(device) if use_cuda else
                   f"CPU {platform.machine()}, {torch.get_num_threads()} threads") + f", torch {torch.__version__}"
    try:
        seqs = [int(s) for s in args.seq_lens.split(",")]
    except ValueError:
        raise SystemExit(f"--seq-lens: expected comma-separated integers (got {args.seq_lens!r})") from None
    for name in args.models.split(","):
        try:
            model_config(name, seq_len=max(seqs))
        except ValueError as err:   # an unknown name, a JSON that is not a causal LM, too few positions
            raise SystemExit(f"--models: {err}") from None
    rows = []
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None   # other work on the machine
    t0 = time.time()
    for name in args.models.split(","):
        for seq in seqs:
            for impl in ("sdpa", "eager"):
                r = measure(name, impl, seq, args.batch, args.repeat, device, profile_ops=seq == seqs[0])
                rows.append(r)
                print(f"  {name} seq {seq} {impl}: {r['step_ms']:.1f} ms, {r['activation_mb']:.1f} MB saved",
                      flush=True)
    result = {"device": device_name, "batch": args.batch, "repeat": args.repeat, "rows": rows,
              "load_average_1min_at_start": load,
              "seconds": round(time.time() - t0, 1),
              "memory": "activation_mb = bytes of tensors autograd saves for backward (unique storages, "
                        "parameters excluded); peak_mb = CUDA allocator peak during a step minus before it"}
    print()
    print(format_table(rows, device_name))
    path = args.json or DEFAULT_DIR / f"attention-{device.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
