"""Metric modules for ``evaluate``, loaded by absolute path (never by hub name).

Each metric lives in ``<name>/<name>.py`` next to this file. ``evaluate.load("perplexity")``
would first look for ``./perplexity/perplexity.py`` in the *current directory* and then ask the
Hugging Face hub, so a stray folder or a hub update could change a gate's score. Loading the
absolute path of the shipped file removes both: the score depends only on this package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import evaluate

METRICS_DIR = Path(__file__).resolve().parent


def known_metrics() -> list[str]:
    """Names of the shipped metric modules (folders holding ``<name>/<name>.py``)."""
    return sorted(
        entry.name for entry in METRICS_DIR.iterdir() if (entry / f"{entry.name}.py").is_file()
    )


def load_metric(name: str, **kwargs: Any) -> evaluate.EvaluationModule:
    """Load the shipped metric ``name`` (``"pass_at_k"``, ``"perplexity"``) with ``evaluate``.

    The hub is never consulted: HF_HUB_OFFLINE, HF_DATASETS_OFFLINE and HF_EVALUATE_OFFLINE are
    set to 1 before ``evaluate`` is imported unless the caller already set them (a real engine in
    the same process may need the hub for its own files). Inputs are kept in memory
    (``keep_in_memory=True``) unless ``kwargs`` say otherwise, so scoring writes no cache files.
    """
    known = known_metrics()
    if name not in known:
        raise ValueError(f"unknown metric {name!r}; known metrics: {', '.join(known)}")
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        os.environ.setdefault(variable, "1")
    import evaluate

    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(METRICS_DIR / name / f"{name}.py"), **kwargs)
