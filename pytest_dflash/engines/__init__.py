"""Engines for model-level gates: the protocol every engine offers (docs/extending.md).

The embedded default is the reference engine (``pytest_dflash.engines.reference``); an engine
over an OpenAI-compatible server is ``pytest_dflash.engines.openai_server``; other engines plug
in through the ``pytest_dflash_engine`` hook and only have to offer these methods.

Not every engine can offer every measurement: a server returns top-k log-probs, not full
logits, and cannot run a verify step of M <= 8 rows on a cached prefix. An engine says what it
offers in ``capabilities``; a gate that needs what is missing stays pending with the reason
(:func:`missing`), never failed and never passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

# What a model-level gate may need beyond score/generate/encode, which every engine offers.
CAPABILITIES: tuple[str, ...] = ("prefill_timing", "first_token_hash", "verify_logits",
                                 "route_hits", "position_logits", "prompt_logprobs")


class EngineUnsupported(RuntimeError):
    """The engine cannot do this at all (not a failure of the route it runs)."""


class EngineError(ValueError):
    """A call, selection or model an engine cannot run; the message says what to change."""


def check_positions(positions: Sequence[int], length: int, what: str) -> list[int]:
    """``positions`` as ints, each inside a prompt of ``length`` tokens, else an EngineError
    naming the first bad ones (``prefill_logits`` of every in-process engine)."""
    where = [int(p) for p in positions]
    bad = [p for p in where if not 0 <= p < length]
    if bad:
        raise EngineError(f"{what}: positions {bad[:5]} are outside the prompt of "
                          f"{length} tokens (0..{length - 1})")
    return where


@dataclass(frozen=True)
class Capabilities:
    """What an engine offers beyond score/generate/encode.

    - ``prefill_timing``: ``prefill()`` returns a meaningful wall time of the prefill (for a
      server: time to first token) and ``reset_prefix_cache()`` makes the next one cold;
    - ``first_token_hash``: ``prefill()`` hashes the first token's *full* logits, so two runs of
      one route can be proven bitwise identical;
    - ``verify_logits``: ``verify(draft)`` returns logits [M, vocab] for M <= 8 draft rows on
      top of the cached prefix (speculative decoding's verify step);
    - ``route_hits``: ``route_hits()`` counts, in process, which route each op call took;
    - ``position_logits``: ``prefill_logits(ids, positions)`` returns the full next-token
      log-probs [len(positions), vocab] at chosen positions of one cold prefill, which stays
      cached for ``verify`` (the cold-prefill agreement check compares them across routes).
    - ``prompt_logprobs``: ``score(ids)`` returns the log-prob of every token of a sequence
      (a server needs a tokenize endpoint and echoed prompt log-probs for it).

    ``reasons`` says, per missing capability, why the engine cannot offer it.
    """

    prefill_timing: bool = True
    first_token_hash: bool = True
    verify_logits: bool = True
    route_hits: bool = True
    position_logits: bool = True
    prompt_logprobs: bool = True
    reasons: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.reasons) - set(CAPABILITIES)
        if unknown:
            raise ValueError(f"reasons name unknown capabilities {sorted(unknown)}; known: "
                             f"{', '.join(CAPABILITIES)}")
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))

    def offers(self, name: str) -> bool:
        if name not in CAPABILITIES:
            raise ValueError(f"unknown engine capability {name!r}; known: "
                             f"{', '.join(CAPABILITIES)}")
        return bool(getattr(self, name))

    def as_dict(self) -> dict[str, Any]:
        return {**{name: self.offers(name) for name in CAPABILITIES},
                "reasons": dict(self.reasons)}


# An engine that declares nothing is an in-process engine of the original protocol.
IN_PROCESS = Capabilities()


def capabilities_of(engine: Engine) -> Capabilities:
    caps = getattr(engine, "capabilities", None)
    if caps is None:
        return IN_PROCESS
    if not isinstance(caps, Capabilities):
        raise TypeError(f"{engine!r}.capabilities must be a pytest_dflash.engines.Capabilities, "
                        f"got {type(caps).__name__}")
    return caps


def missing(engines: Iterable[Any], needed: Iterable[str]) -> str | None:
    """None if every engine offers every needed capability, else the reason a gate stays
    pending, naming the engine, the capability and why it is missing."""
    needed = list(needed)
    problems = []
    for engine in engines:
        caps = capabilities_of(engine)
        for name in needed:
            if not caps.offers(name):
                why = caps.reasons.get(name, "not offered")
                problems.append(f"{name} ({why})")
        if problems:
            return f"engine {engine!r} does not offer " + "; ".join(problems)
    return None


@dataclass
class PrefillResult:
    first_token: int
    first_token_hash: str  # sha256 of the first token's logits bytes ("" without the capability)
    prompt_tokens: int
    seconds: float
    chunks: int | None  # prefill chunks run (None when the engine cannot tell)


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
    ) -> Generation:
        """Complete ``prompt`` (text; the engine adds its BOS itself, as a server does)."""

    def verify(self, draft_ids: list[int]) -> Any:
        """Logits [M, vocab] for M = len(draft_ids) <= 8 rows on top of the cached prefix."""

    def prefill_logits(self, token_ids: list[int], positions: list[int]) -> Any:
        """Log-probs [len(positions), vocab] of the next token after each position, from one
        cold prefill of ``token_ids`` that stays cached for :meth:`verify`."""

    def reset_prefix_cache(self) -> None: ...

    def route_hits(self) -> dict[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's BOS (if it has one)
        in front, exactly as the engine itself would prefix a prompt. Gates never build BOS
        ids by hand: tokenizers differ."""


def generate_all(
    engine: Engine, prompts: list[str], max_new_tokens: int, stop: list[str] | None,
    sampling: Sampling, batch: int,
    on_complete: Callable[[int, Generation], None] | None = None,
) -> tuple[list[Generation], str]:
    """Every prompt's completion, in prompt order, and how they were decoded (for the report).

    An engine with ``generate_many(prompts, max_new_tokens, stop, sampling, batch=,
    on_complete=)`` decodes up to ``batch`` sequences per step (the reference engine does); any
    other engine completes them one at a time through ``generate``. ``on_complete(index,
    generation)`` is called as each completion finishes either way.
    """
    many = getattr(engine, "generate_many", None)
    if callable(many):
        gens = many(prompts, max_new_tokens, stop, sampling, batch=batch, on_complete=on_complete)
        return list(gens), f"generate_many, up to {batch} sequences per decode step"
    gens = []
    for index, prompt in enumerate(prompts):
        gens.append(engine.generate(prompt, max_new_tokens, stop, sampling))
        if on_complete is not None:
            on_complete(index, gens[-1])
    return gens, "generate, one completion at a time"


def close(engine: Engine) -> None:
    """Release what an engine holds (a server process, a connection); engines without a
    ``close`` hold nothing that outlives them."""
    closer = getattr(engine, "close", None)
    if callable(closer):
        closer()
