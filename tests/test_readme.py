"""The README's quick-start commands are the ones CI runs and the ones that exist."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_quick_start_has_two_commands_and_ci_runs_the_test_one():
    install_and_train, install_and_test = quick_start_commands()
    assert "launch/install.sh" in install_and_train and "ds-hybrid train" in install_and_train
    assert "pytest" in install_and_test
    ci = (ROOT / ".ci" / "run").read_text()
    assert install_and_test in ci.splitlines(), ".ci/run must run the README's test command verbatim"


def test_readme_cli_examples_name_real_commands():
    from ds_hybrid.cli import COMMANDS
    text = (ROOT / "README.md").read_text()
    used = set(re.findall(r"ds-hybrid ([\w-]+)", text))
    assert used <= set(COMMANDS), used - set(COMMANDS)
