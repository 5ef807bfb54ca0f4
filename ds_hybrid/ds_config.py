"""A ds_config as DeepSpeed reads one: a dict, a JSON or hjson file, or a base64 string.

``ds_hybrid.initialize`` and ``ds-hybrid train`` read the config here before DeepSpeed builds
anything, so that the ``hybrid_predict`` section is checked first and errors name the file.
"""
from __future__ import annotations

import os
from typing import Any, Mapping


class ConfigFileNotFoundError(FileNotFoundError, ValueError):
    """A ds_config path that names no file: ``deepspeed.initialize`` raises ``ValueError`` there."""


def _parse_config_text(text: str) -> Any:
    """JSON first (hjson reads 1.0 as the int 1, and the hybrid_predict section is strictly typed),
    then hjson, which DeepSpeed also reads; duplicate keys are rejected either way."""
    import json

    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys
    try:
        return json.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    except json.JSONDecodeError:
        return hjson.loads(text, object_pairs_hook=dict_raise_error_on_duplicate_keys)


def load_ds_config(config: Any) -> dict:
    """A ds_config dict as DeepSpeed reads one (``DeepSpeedConfig``): a dict; a path to a JSON or
    hjson file, duplicate keys rejected; or a base64-encoded config string. Errors name the file."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise ValueError(f"ds_config: expected a dict, a path to a JSON or hjson file, or a base64-encoded config "
                         f"string; got {type(config).__name__}")
    import base64
    import binascii
    from pathlib import Path

    import hjson
    path = Path(config)
    try:
        is_file = path.is_file()
    except OSError:   # a base64 config is longer than a file name may be
        is_file = False
    if is_file:
        try:
            return dict(_parse_config_text(path.read_text()))
        except hjson.HjsonDecodeError as err:
            raise ValueError(f"ds_config file {path} is not valid JSON (nor hjson, which DeepSpeed also reads): "
                             f"{err}") from None
        except ValueError as err:   # duplicate keys
            raise ValueError(f"ds_config file {path}: {err}") from None
    if isinstance(config, str):
        try:
            loaded = _parse_config_text(base64.urlsafe_b64decode(config).decode("utf-8"))
            if isinstance(loaded, Mapping):
                return dict(loaded)
        except (binascii.Error, UnicodeDecodeError, hjson.HjsonDecodeError, ValueError):
            pass
    raise ConfigFileNotFoundError(f"ds_config file not found: {path} (a ds_config is a dict, a path to a JSON or hjson "
                            "file, or a base64-encoded config string)")
