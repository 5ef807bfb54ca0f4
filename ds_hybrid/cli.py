"""``ds-hybrid``: the command-line entry point.

    ds-hybrid train [--config PRESET_OR_JSON] [--data PATH] [--steps N] ...
    ds-hybrid compare RUN_DIR... [--json PATH]
    ds-hybrid bench [--suite cpu-small] [--quick] [--readme] ...
    ds-hybrid report [--json PATH]
    ds-hybrid kernel-bench [--cpu-reference] [--json PATH]
    ds-hybrid attn-bench [--models gpt2-tiny] [--seq-lens 64,...,1024] [--json PATH]
    ds-hybrid plan --model NAME --gpu-mem 24GB --cpu-mem 128GB [--nvme 500GB] [--json PATH]
    ds-hybrid memory-bench [--models gpt2-tiny gpt2-124m] [--json PATH]

For multi-rank runs use the ``deepspeed`` launcher with ``-m ds_hybrid.train``
(see launch/).
"""
from __future__ import annotations

import sys

COMMANDS = {
    "train": "train a model with the PredictiveEngine (default: tiny GPT-2 on the stdlib source, CPU)",
    "compare": "tabulate finished train runs (per run, and mean +- std over seeds)",
    "bench": "hybrid against plain DeepSpeed to a target validation loss (suites: cpu-small, gpu-gpt2, offload)",
    "report": "what this machine offers: GPU, CuPy, NVML, DeepSpeed ops, libaio, nvcc, kernel backend",
    "kernel-bench": "the CUDA kernels against their torch references (needs a GPU; --cpu-reference without)",
    "attn-bench": "fused (SDPA) against eager attention: step time and activation memory by sequence length",
    "plan": "memory each preset needs for a model on a machine (GPU, CPU, NVMe), which fit, which to use",
    "memory-bench": "memory per phase (host; GPU allocator and NVML on a GPU): plain DeepSpeed (Full) against Predict",
    "dynamics-eval": "loss-forecast error of the RSSM against naive predictors on recorded trajectories; "
                     "--runs: the engine's predictors side by side",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ds-hybrid COMMAND [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<14}{text}")
        print("\n'ds-hybrid COMMAND --help' lists a command's options.")
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
    if command == "dynamics-eval":
        from .dynamics import evaluate
        evaluate.main(rest)
        return
    raise SystemExit(f"ds-hybrid: unknown command '{command}' (commands: {', '.join(COMMANDS)})")


if __name__ == "__main__":
    main()
