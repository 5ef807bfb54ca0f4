"""Trajectory files: one JSON line per optimizer step, the ``Observation`` the
predictor saw, so predictors can be trained and evaluated offline on real runs."""
from __future__ import annotations

import json
from pathlib import Path

from .encoder import Observation


class TrajectoryWriter:
    def __init__(self, path: str | Path, meta: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)
        if meta is not None and self.path.stat().st_size == 0:
            self._f.write(json.dumps({"meta": meta}) + "\n")

    def write(self, obs: Observation) -> None:
        self._f.write(json.dumps(obs.as_dict()) + "\n")

    def close(self) -> None:
        self._f.close()


def read_trajectory(path: str | Path) -> tuple[dict, list[Observation]]:
    """(meta, observations) of a trajectory file; the error names the file and line."""
    meta: dict = {}
    out: list[Observation] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if "meta" in d:
                    meta = d["meta"]
                else:
                    out.append(Observation(**d))
            except (json.JSONDecodeError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not a trajectory record ({err})") from None
    return meta, out
