"""Held-out data of the model-level gates (ppl, quality, prefill speed, engine validation cost).

The JSONL files ship in ``dflash_fixtures/data`` and are read with ``datasets`` (offline: the
hub is never asked), so a real engine's project can point the same gates at its own JSONL files.
How much of them a profile uses is declared with every other size in
``pytest_dflash.policy.profiles``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_dflash.policy.profiles import sizes

PPL_FILE = "ppl_segments.jsonl"
LONG_FILE = "long_contexts.jsonl"
TASKS_FILE = "coding_tasks.jsonl"
# the keys each row must have (string values, non-empty): the schema of the shipped files
SCHEMA: dict[str, tuple[str, ...]] = {PPL_FILE: ("id", "text"), LONG_FILE: ("id", "text"),
                                      TASKS_FILE: ("task_id", "prompt", "test")}


class DataError(ValueError):
    """A data override that is missing or does not follow the shipped JSONL schema."""


def data_dir(override: str | Path | None = None) -> Path:
    """The held-out data: ``override`` (``--dflash-data DIR``) if given, else the shipped."""
    if override is not None:
        return check_data_dir(override)
    import dflash_fixtures

    return Path(dflash_fixtures.__file__).resolve().parent / "data"


def check_data_dir(directory: str | Path) -> Path:
    """``directory`` must exist and hold at least one of the data files, each valid JSONL of
    the shipped schema; the error names the file, the line and the fix."""
    path = Path(directory).expanduser().resolve()
    if not path.is_dir():
        raise DataError(f"--dflash-data {directory}: no such directory")
    present = [name for name in SCHEMA if (path / name).is_file()]
    if not present:
        raise DataError(f"--dflash-data {directory}: holds none of {', '.join(SCHEMA)}; put one "
                        f"JSONL row per segment, context or task there (schema: "
                        + ", ".join(f"{name} {keys}" for name, keys in SCHEMA.items()) + ")")
    for name in present:
        validate_jsonl(path / name, SCHEMA[name])
    return path


def validate_jsonl(path: Path, keys: tuple[str, ...]) -> int:
    """Row count of ``path`` after checking every line is a JSON object with ``keys`` as
    non-empty strings (and unique first keys: ids name the rows in the report)."""
    seen: set[str] = set()
    rows = 0
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg}); each line must be one JSON "
                                f"object with keys {', '.join(keys)}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a JSON {type(row).__name__}, expected an object with"
                                f" keys {', '.join(keys)}")
            for key in keys:
                value = row.get(key)
                if not isinstance(value, str) or not value:
                    raise DataError(f"{where}: key {key!r} must be a non-empty string, got "
                                    f"{value!r:.60}; rows need {', '.join(keys)}")
            if row[keys[0]] in seen:
                raise DataError(f"{where}: {keys[0]} {row[keys[0]]!r} appears twice; ids must "
                                "be unique")
            seen.add(row[keys[0]])
            rows += 1
    if rows == 0:
        raise DataError(f"{path}: no rows; put one JSON object per line")
    return rows


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file through ``datasets`` with the hub switched off."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the held-out data ships in "
                                f"{data_dir()} (regenerate with python -m "
                                "dflash_fixtures.make_data --heldout)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    ds = datasets.load_dataset("json", data_files=str(path), split="train", keep_in_memory=True)
    return [dict(row) for row in ds]


def _rows(name: str, count: int, directory: str | Path | None) -> list[dict[str, Any]]:
    base = data_dir(directory)
    if directory is not None and not (base / name).is_file():
        raise DataError(f"--dflash-data {directory}: has no {name}, which this gate needs "
                        f"(rows with keys {', '.join(SCHEMA[name])})")
    return load_jsonl(base / name)[:count]


def ppl_segments(profile: str, directory: str | Path | None = None) -> list[dict[str, Any]]:
    """The profile's held-out segments, each cut to its byte budget at a character boundary."""
    size = sizes(profile)
    out = []
    for row in _rows(PPL_FILE, size.ppl_segments, directory):
        text = row["text"].encode("utf-8")[: size.ppl_bytes].decode("utf-8", errors="ignore")
        out.append({**row, "text": text})
    return out


def long_contexts(profile: str, encode: Callable[..., list[int]], min_tokens: int,
                  directory: str | Path | None = None) -> list[dict[str, Any]]:
    """The profile's held-out long contexts (whole modules concatenated, never trained on), each
    as ``ids``: the engine's BOS (``encode(text, add_special_tokens=True)``) and the first
    tokens of its text, ``min_tokens`` in all, so that every chunk seam the gate bands by lies
    inside. A context too short for that is an error naming it and the fix, never a silently
    shorter gate."""
    count = sizes(profile).ppl_long_contexts
    rows = _rows(LONG_FILE, count, directory)
    if len(rows) < count:
        raise DataError(f"{LONG_FILE} has {len(rows)} contexts, profile {profile!r} scores "
                        f"{count}; add contexts (whole held-out documents concatenated)")
    out = []
    for row in rows:
        ids = encode(row["text"], add_special_tokens=True)
        if len(ids) < min_tokens:
            raise DataError(f"{LONG_FILE} context {row['id']!r} encodes to {len(ids)} tokens, "
                            f"the ppl gate needs {min_tokens} (at least 3 seams of every "
                            f"selected chunk size); make its text longer")
        out.append({"id": row["id"], "ids": ids[:min_tokens]})
    return out


def coding_tasks(profile: str, directory: str | Path | None = None) -> list[dict[str, Any]]:
    return _rows(TASKS_FILE, sizes(profile).quality_tasks, directory)


def prompt_ids(length: int, encode: Callable[..., list[int]] | None = None,
               directory: str | Path | None = None) -> list[int]:
    """A deterministic prompt of exactly ``length`` tokens: the engine's BOS (``encode(text,
    add_special_tokens=True)``) then held-out source text, repeated as needed, so every route
    prefills the very same tokens. Without ``encode``: the reference model's tokenizer."""
    if encode is None:
        from pytest_dflash.engines.tokenizer import encode as byte_encode

        def encode(text: str, add_special_tokens: bool = False) -> list[int]:
            return byte_encode(text, bos=add_special_tokens)

    text = "".join(row["text"] for row in load_jsonl(data_dir(directory) / PPL_FILE))
    ids = encode(text, add_special_tokens=True)
    body = encode(text)
    head = ids[: len(ids) - len(body)]  # what the tokenizer puts in front (BOS), maybe nothing
    if not body:
        raise DataError("the held-out text encodes to no tokens")
    out = list(head)
    while len(out) < length:
        out += body[: length - len(out)]
    return out[:length]
