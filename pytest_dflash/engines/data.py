"""Held-out data and per-profile sizes of the model-level gates (ppl, quality, speed, validation).

The JSONL files ship in ``dflash_fixtures/data`` and are read with ``datasets`` (offline: the
hub is never asked), so a real engine's project can point the same gates at its own JSONL files.
Sizes per profile are fixed here, in one table, so every gate of a profile measures the same
amount of work on every run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_dflash.gates import PROFILES


@dataclass(frozen=True)
class Sizes:
    ppl_segments: int  # held-out segments scored
    ppl_bytes: int  # bytes of each segment scored (BOS-prefixed)
    quality_tasks: int  # held-out coding tasks generated per route
    prefill_lengths: tuple[int, int]  # cold prefill prompt lengths, in the 32K:64K ratio
    verify_prompt: int  # prompt length prefilled before the verify steps


SIZES: dict[str, Sizes] = {
    "quick": Sizes(2, 128, 4, (256, 512), 64),
    "ci": Sizes(8, 512, 20, (512, 1024), 512),
    "full": Sizes(16, 1024, 300, (32768, 65536), 4096),
}


def sizes(profile: str) -> Sizes:
    if profile not in SIZES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    return SIZES[profile]


def data_dir() -> Path:
    import dflash_fixtures

    return Path(dflash_fixtures.__file__).resolve().parent / "data"


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


def ppl_segments(profile: str) -> list[dict[str, Any]]:
    """The profile's held-out segments, each cut to its byte budget at a character boundary."""
    size = sizes(profile)
    rows = load_jsonl(data_dir() / "ppl_segments.jsonl")[: size.ppl_segments]
    out = []
    for row in rows:
        text = row["text"].encode("utf-8")[: size.ppl_bytes].decode("utf-8", errors="ignore")
        out.append({**row, "text": text})
    return out


def coding_tasks(profile: str) -> list[dict[str, Any]]:
    return load_jsonl(data_dir() / "coding_tasks.jsonl")[: sizes(profile).quality_tasks]


def prompt_ids(length: int) -> list[int]:
    """A deterministic BOS-prefixed prompt of exactly ``length`` tokens (held-out source text,
    repeated as needed), so every route prefills the very same tokens."""
    from pytest_dflash.engines.tokenizer import BOS, encode

    text = "".join(row["text"] for row in load_jsonl(data_dir() / "ppl_segments.jsonl"))
    body = encode(text)
    ids = [BOS]
    while len(ids) < length:
        ids += body[: length - len(ids)]
    return ids
