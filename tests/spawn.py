"""Run code under test in other processes, and the small inputs those runs need.

``run_ranks`` starts N gloo ranks of a worker script and collects what each reported.
A rank that does not finish within the timeout means a collective was left waiting
(or a rank died): every rank is killed and the test fails with each rank's output.
Multi-rank CPU runs can abort at interpreter exit after the work is done, so a rank
counts as finished when it printed ``RANK{r} DONE``, not by its exit status.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port

HERE = Path(__file__).parent


def rank_env(rank: int, world: int, port: int) -> dict:
    """The environment a launcher gives rank ``rank`` of ``world`` (one thread each: 2 shared cores)."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))


def run_ranks(script: str, args: list[str], world: int, out_dir: Path, timeout: float = 300,
              env: dict | None = None) -> list[dict]:
    """Run ``tests/<script> <args> --out <out_dir>`` as ``world`` ranks (``env`` added to each
    rank's environment); return each rank's ``rank{r}.json`` (the worker writes it before its
    DONE marker)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / script), *args, "--out", str(out_dir)],
                              env={**rank_env(rank, world, port), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for rank in range(world)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = "\n".join(f"--- rank {r}:\n{(p.communicate()[0] or '')[-1500:]}" for r, p in enumerate(procs))
        raise AssertionError(f"ranks hung for {timeout}s (a collective was not reached by every rank)\n{tails}")
    for rank, out in enumerate(outputs):
        assert f"RANK{rank} DONE" in out, f"rank {rank} failed:\n{out[-4000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


def write_corpus(folder: Path) -> Path:
    """A small text corpus (a few KB of Python-like lines) for the main job."""
    path = folder / "corpus.txt"
    path.write_text("def add(a, b):\n    return a + b\n\n" * 400)
    return path


def write_eager_preset(folder: Path) -> Path:
    """tiny-cpu with micro batch 4 and a phase cycle that reaches Predict within a few steps."""
    cfg = json.loads((HERE.parent / "ds_configs" / "tiny-cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["hybrid_predict"].update(warmup_steps=4, full_steps=2, confidence_threshold=0.0, min_predict_steps=3,
                                 max_predict_steps=3, verify_every=2, correction_steps=1, predict_lr_fraction=1.0)
    path = folder / "eager.json"
    path.write_text(json.dumps(cfg))
    return path


def main_job_args(corpus: Path, preset: Path, steps: int) -> list[str]:
    """ds-hybrid train arguments for a small, quick run on ``corpus`` with ``preset``."""
    return ["--data", str(corpus), "--config", str(preset), "--steps", str(steps), "--seq-len", "32",
            "--model", "gpt2-test", "--val-batches", "2", "--no-progress", "--no-plot"]
