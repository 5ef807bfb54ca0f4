"""Command-line inputs that several commands share.

``resolve_config``: a ds_config from a path or a preset name in ``ds_configs/`` (``train``,
``bench``, ``memory-bench``, ``plan --validate``); ``parse_size``: memory sizes such as
``24GB`` (``plan``, ``train --gpu-mem-cap``); ``HelpFormatter``: help lines that state a
default once. Errors name the flag. Nothing here imports torch or DeepSpeed at import time,
so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import math
import re
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = REPO_ROOT / "ds_configs"
KiB, MiB, GiB, TiB = 2 ** 10, 2 ** 20, 2 ** 30, 2 ** 40


class InputError(ValueError):
    """A command-line value that cannot be used; the message names the flag."""


# ---------------------------------------------------------------- presets
def preset_names() -> list[str]:
    """The presets in ``ds_configs/``, by name (file stem)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) if PRESET_DIR.is_dir() else []


def find_preset(name_or_path: str, flag: str = "--config") -> Path:
    """A ds_config file: the path itself when it is a file, else the preset of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = PRESET_DIR / (name_or_path if name_or_path.endswith(".json") else f"{name_or_path}.json")
    if preset.is_file():
        return preset
    raise InputError(f"{flag}: '{name_or_path}' is neither a file nor a preset (presets: {preset_names()})")


def resolve_config(name_or_path: str, flag: str = "--config") -> tuple[dict, Path]:
    """A ds_config dict from a path or a preset name, read as DeepSpeed reads it (JSON or
    hjson, duplicate keys rejected); a missing or unreadable file exits naming ``flag``."""
    from .ds_config import load_ds_config
    try:
        path = find_preset(name_or_path, flag)
        return load_ds_config(path), path
    except ValueError as err:   # InputError, or a file that is neither JSON nor hjson
        message = str(err)
        raise SystemExit(message if message.startswith(flag) else f"{flag}: {message}") from None


# ---------------------------------------------------------------- sizes
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1,
          "k": KiB, "kib": KiB, "ki": KiB, "kb": 10 ** 3,
          "m": MiB, "mib": MiB, "mi": MiB, "mb": 10 ** 6,
          "g": GiB, "gib": GiB, "gi": GiB, "gb": 10 ** 9,
          "t": TiB, "tib": TiB, "ti": TiB, "tb": 10 ** 12}


def parse_size(text: str | int | float, flag: str = "size") -> int:
    """Bytes from ``'24GB'`` (10**9), ``'24GiB'`` / ``'24G'`` (2**30), ``'500M'``, ``'1.5TB'`` or a
    plain number of bytes. SI suffixes (kB, MB, GB, TB) are powers of 10; IEC ones (KiB, MiB,
    GiB, TiB) and bare letters (K, M, G, T) are powers of 2. Errors (``InputError``) name ``flag``."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE_RE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise InputError(f"{flag}: cannot read {text!r} as a memory size "
                             f"(examples: 24GB, 24GiB, 500G, 1.5TB, 25769803776)")
        value, unit = float(m.group(1)), m.group(2).lower()
    out = value * _UNITS[unit]
    if not math.isfinite(out) or out < 0:
        raise InputError(f"{flag}: a memory size must be 0 or more (got {text!r})")
    return int(out)


# ---------------------------------------------------------------- help
class HelpFormatter(argparse.HelpFormatter):
    """Appends ``(default: X)`` to an option's help once: not when the help already says its
    default, and not for defaults that say nothing (None, False, an empty list). The
    description and epilog keep their line breaks (each line wrapped by itself, never inside a
    hyphenated name such as a preset's)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(" ".join(line.split()), width, initial_indent=indent, subsequent_indent=indent,
                                       break_on_hyphens=False, break_long_words=False) if line.strip() else ""
                         for line in text.splitlines())

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == []
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"
