"""``ds-hybrid``: the command-line entry point.

    ds-hybrid train [--config PRESET_OR_JSON] [--data PATH] [--steps N] ...
    ds-hybrid compare RUN_DIR... [--json PATH]
    ds-hybrid bench [--suite cpu-small] [--quick] [--readme] ...

For multi-rank runs use the ``deepspeed`` launcher with ``-m ds_hybrid.train``
(see launch/).
"""
from __future__ import annotations

import sys

COMMANDS = {
    "train": "train a model with the PredictiveEngine (default: tiny GPT-2 on the stdlib source, CPU)",
    "compare": "tabulate finished train runs (per run, and mean +- std over seeds)",
    "bench": "hybrid against plain DeepSpeed to a target validation loss (suites: cpu-small, gpu-gpt2, offload)",
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: ds-hybrid COMMAND [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<8}{text}")
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
    raise SystemExit(f"ds-hybrid: unknown command '{command}' (commands: {', '.join(COMMANDS)})")


if __name__ == "__main__":
    main()
