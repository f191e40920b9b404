"""The one way evidence reaches a file: whole or not at all.

Reports, the run history and the xdist workers' group maps are read by other processes (the
CLI, the controller, a later run) while they may be written; a reader must never see half a
file. Everything is written to a temporary file in the target's folder and renamed over it.
A path ending in ``.gz`` is written gzip-compressed (:func:`read_text` reads both forms).
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json(data: Any, path: Path | str, *, indent: int | None = 2) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file + rename), folder created.

    ``indent=None`` writes the compact form (no spaces after separators), as reports are."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    separators = (",", ":") if indent is None else None
    text = json.dumps(data, indent=indent, separators=separators, default=str) + "\n"
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            payload = text.encode("utf-8")
            out.write(gzip.compress(payload, mtime=0) if path.name.endswith(".gz") else payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_text(path: Path | str) -> str:
    """A JSON file's text, gunzipped when its name ends in ``.gz``.

    Raises OSError, UnicodeDecodeError, or ValueError for a ``.gz`` that is not gzip data."""
    path = Path(path)
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValueError(f"not gzip data ({exc})") from None
    return raw.decode("utf-8")
