"""``ds-hybrid``: the command-line entry point.

    ds-hybrid train [--config PRESET_OR_JSON | --deepspeed_config JSON] [--data PATH] [--steps N] ...
    ds-hybrid compare RUN_DIR... [--json PATH]
    ds-hybrid bench [--suite cpu-small] [--quick] [--readme] ...
    ds-hybrid report [--json PATH]
    ds-hybrid kernel-bench [--cpu-reference] [--json PATH]
    ds-hybrid attn-bench [--models gpt2-tiny] [--seq-lens 64,...,1024] [--json PATH]
    ds-hybrid plan --model NAME --gpu-mem 24GB --cpu-mem 128GB [--nvme 500GB] [--json PATH]
    ds-hybrid memory-bench [--models gpt2-tiny gpt2-124m] [--out DIR] [--json PATH]
    ds-hybrid build-ops [--config PRESET_OR_JSON | --ops OP... | --all] [--jobs N]
    ds-hybrid --version

Results go under ``runs/`` in the current directory unless a flag names another place;
nothing writes into the repository's ``docs/`` unless its path is passed. For multi-rank
runs use the ``deepspeed`` launcher with ``-m ds_hybrid.train`` (see launch/).
"""
from __future__ import annotations

import sys
from importlib import metadata

COMMANDS = {
    "train": "train a model with the PredictiveEngine (default: gpt2-tiny, 0.84M parameters, 600 steps on the "
             "stdlib source, CPU; writes runs/train)",
    "compare": "tabulate finished train runs (per run, and mean +- std over seeds)",
    "bench": "hybrid against plain DeepSpeed to a target validation loss (suites: cpu-small, cpu-finetune, "
             "gpu-gpt2, offload)",
    "report": "what this machine offers: GPU, CuPy, NVML, DeepSpeed ops, libaio, nvcc, kernel backend",
    "kernel-bench": "the CUDA kernels against their torch references (needs a GPU; --cpu-reference without)",
    "attn-bench": "fused (SDPA) against eager attention: step time and activation memory by sequence length",
    "plan": "memory each preset needs for a model on a machine (GPU, CPU, NVMe), which fit, which to use",
    "memory-bench": "memory per phase (host; GPU allocator and NVML on a GPU): plain DeepSpeed (Full) against Predict",
    "dynamics-eval": "loss-forecast error of the RSSM against naive predictors on recorded trajectories; "
                     "--runs: the engine's predictors side by side",
    "build-ops": "build DeepSpeed's JIT-compiled ops (and the host fold) ahead of a run, several at a time",
}


def version() -> str:
    """ds_hybrid's version and the versions it runs on (read from the installed metadata: no
    torch or DeepSpeed import)."""
    from . import __version__
    found = []
    for dist in ("deepspeed", "torch", "transformers"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            found.append(f"{dist} not installed")
    return f"ds-hybrid {__version__} ({', '.join(found)}; Python {sys.version.split()[0]})"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ds-hybrid COMMAND [options]\n       ds-hybrid --version\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<14}{text}")
        print("\n'ds-hybrid COMMAND --help' lists a command's options ('ds-hybrid train --help': the presets and "
              "models too).")
        return
    if argv[0] in ("-V", "--version"):
        print(version())
        return
    command, rest = argv[0], argv[1:]
    if command == "train":
        from . import train
        train.run_cli(rest)
        return
    if command == "bench":
        from . import bench
        bench.main(rest)
        return
    if command == "compare":
        from . import compare
        compare.main(rest)
        return
    if command == "report":
        from . import report
        report.main(rest)
        return
    if command == "kernel-bench":
        from . import kernel_bench
        kernel_bench.main(rest)
        return
    if command == "attn-bench":
        from . import attn_bench
        attn_bench.main(rest)
        return
    if command in ("plan", "memory-bench"):
        from .memory import bench as memory_bench, planner
        (planner if command == "plan" else memory_bench).main(rest)
        return
    if command == "build-ops":
        from . import op_build
        op_build.main(rest)
        return
    if command == "dynamics-eval":
        from .dynamics import evaluate
        evaluate.main(rest)
        return
    raise SystemExit(f"ds-hybrid: unknown command '{command}' (commands: {', '.join(COMMANDS)})")


if __name__ == "__main__":
    main()
