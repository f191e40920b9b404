"""Engines for model-level gates: the protocol every engine offers (DESIGN 4).

The embedded default is the reference engine (``pytest_dflash.engines.reference``); real engines
plug in through the ``pytest_dflash_engine`` hook and only have to offer these methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class PrefillResult:
    first_token: int
    first_token_hash: str  # sha256 of the first token's logits bytes (same route, same hash)
    prompt_tokens: int
    seconds: float
    chunks: int


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass
class Sampling:
    """Predeclared decoding: greedy unless temperature > 0, then seeded."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    selection: dict[str, str]

    def prefill(self, token_ids: list[int]) -> PrefillResult: ...

    def score(self, token_ids: list[int]) -> list[float]:
        """Natural-log probability of token i+1 given tokens 0..i, for every i."""

    def generate(
        self, prompt: str, max_new_tokens: int, stop: list[str] | None = None,
        sampling: Sampling | None = None,
    ) -> Generation: ...

    def verify(self, draft_ids: list[int]) -> Any:
        """Logits [M, vocab] for M = len(draft_ids) <= 8 rows on top of the cached prefix."""

    def reset_prefix_cache(self) -> None: ...

    def route_hits(self) -> dict[str, int]: ...

    def encode(self, text: str) -> list[int]: ...
