"""The one way evidence reaches a file: whole or not at all.

Reports, the run history and the xdist workers' group maps are read by other processes (the
CLI, the controller, a later run) while they may be written; a reader must never see half a
file. Everything is written to a temporary file in the target's folder and renamed over it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(data: Any, path: Path | str, *, indent: int | None = 2) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file + rename), folder created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=indent, default=str)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
