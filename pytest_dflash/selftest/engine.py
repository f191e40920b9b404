"""Planted defects that live in an engine: the prefill, ppl and quality defects of every family
an engine applies, and every planted prefill.geometry route.

A geometry route changes how the engine runs, not an op, so its planted copies wrap the engine
that the served selection builds; so do the engine-level defects of attention and GEMM routes
(``Planted.engine_level``) (through the ordinary ``pytest_dflash_engine`` hook: a served
engine is wrapped exactly like the reference engine). The wrapper reports the served route's
hits under the planted route's name, and adds its defect:

* ``slow_*``: every prefill followed by a busy wait (CPU) or spin kernel (GPU) of the fraction
  of that prefill's own measured time;
* ``ppl_shift``: each scored segment's log-probs lowered by ``ln(1 + 2 tol / PPL)``, which raises
  that segment's perplexity by exactly twice the tolerance;
* ``degenerate``: every ``DEGENERATE_EVERY``-th completion replaced by its first characters and
  a run of one repeated character, stopped by length.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_dflash.selftest.catalogue import DEGENERATE_EVERY, Planted
from pytest_dflash.selftest.slowdown import busy_wait, gpu_seconds, gpu_spin

if TYPE_CHECKING:
    import pytest

    from pytest_dflash.engines import Engine
    from pytest_dflash.measure.timing_child import WorkerContext

DEGENERATE_KEEP = 16
DEGENERATE_RUN = 200


class EngineSelftest:
    """An engine of the served selection, seen as the planted route's engine."""

    def __init__(self, inner: Any, planted: Planted, selection: dict[str, str],
                 policy: Any) -> None:
        self.inner = inner
        self.planted = planted
        self.selection = dict(selection)
        self.policy = policy
        self._completions = 0

    def __getattr__(self, attr: str) -> Any:
        # generate_many only where the inner engine has it, and then with the defect planted
        # (forwarded bare, it would bypass the defect: the quality gate prefers it)
        if attr == "generate_many":
            if not callable(getattr(self.inner, "generate_many", None)):
                raise AttributeError(attr)
            return self._generate_many
        # likewise the capturable prefill: the prefill gate captures it on CUDA, and an engine
        # without one (the transformers engine, a server) is timed eagerly
        if attr == "cold_prefill_call":
            if not callable(getattr(self.inner, "cold_prefill_call", None)):
                raise AttributeError(attr)
            return self._cold_prefill_call
        # chunk, device, cfg, ... : whatever else a gate reads off the engine
        return getattr(self.inner, attr)

    @property
    def _defect(self) -> str | None:
        return self.planted.defect.key if self.planted.defect else None

    def prefill(self, token_ids: list[int]) -> Any:
        result = self.inner.prefill(token_ids)
        fraction = self.planted.defect.slowdown if self.planted.defect else None
        if fraction:
            device = getattr(self.inner, "device", None)
            if getattr(device, "type", None) == "cuda":
                gpu_spin(fraction * result.seconds, device)  # the engine synchronized already
            else:
                busy_wait(fraction * result.seconds)
        return result

    def _cold_prefill_call(self, token_ids: list[int]) -> Any:
        """The inner engine's capturable cold prefill, with the planted slowdown inside it: a
        spin kernel after the prefill, of the fraction of the prefill's time as a graph replay,
        so the replays the gate times carry it."""
        call = self.inner.cold_prefill_call(token_ids)
        fraction = self.planted.defect.slowdown if self.planted.defect else None
        return SlowedPrefillCall(call, fraction, self.inner.device) if fraction else call

    def score(self, token_ids: list[int]) -> list[float]:
        logprobs = list(self.inner.score(token_ids))
        if self._defect != "ppl_shift" or not logprobs:
            return logprobs
        # every position loses log(1 + 2 x tolerance): the perplexity rises by that factor
        shift = math.log1p(2 * self.policy.ppl_rel_tolerance)
        return [lp - shift for lp in logprobs]

    def generate(self, prompt: str, max_new_tokens: int, stop: list[str] | None = None,
                 sampling: Any = None) -> Any:
        gen = self.inner.generate(prompt, max_new_tokens, stop, sampling)
        self._completions += 1
        return self._planted(gen, self._completions - 1)

    def _generate_many(self, prompts: list[str], max_new_tokens: int,
                       stop: list[str] | None = None, sampling: Any = None, batch: int = 32,
                       on_complete: Any = None) -> list[Any]:
        """The inner engine's batched completions, the n-th prompt's planted as the n-th
        completion of :meth:`generate` would be (completions finish out of order here)."""
        def finished(index: int, gen: Any) -> None:
            if on_complete is not None:
                on_complete(index, self._planted(gen, index))

        gens = self.inner.generate_many(prompts, max_new_tokens, stop, sampling, batch=batch,
                                        on_complete=finished)
        return [self._planted(gen, index) for index, gen in enumerate(gens)]

    def _planted(self, gen: Any, nth: int) -> Any:
        """Completion ``nth`` (from 0) as the defect leaves it."""
        if self._defect != "degenerate" or nth % DEGENERATE_EVERY:
            return gen
        text = gen.text[:DEGENERATE_KEEP] + "(" * DEGENERATE_RUN
        return type(gen)(text, list(self.inner.encode(text)), "length")

    def verify(self, draft_ids: list[int]) -> Any:
        return self.inner.verify(draft_ids)

    def reset_prefix_cache(self) -> None:
        self.inner.reset_prefix_cache()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def route_hits(self) -> dict[str, int]:
        """The inner engine's hits with the served route's name replaced by the planted one."""
        served, name = self.planted.serves.name, self.planted.name
        renamed: dict[str, int] = {}
        for key, count in self.inner.route_hits().items():
            for sep in ("", ":", "/"):
                if key == served + sep or (sep and key.startswith(served + sep)):
                    key = name + key[len(served):]
                    break
            renamed[key] = renamed.get(key, 0) + count
        return renamed

    def __repr__(self) -> str:
        return f"<self-test engine {self.planted.name} over {self.inner!r}>"


class SlowedPrefillCall:
    """An engine's ``ColdPrefillCall`` followed by a spin kernel of ``fraction`` of its GPU
    time, captured with it. The time is that of the prefill's own graph replay, measured once
    (a capture of the prefill alone, median of three replays timed with events): an eager
    prefill's span is mostly the host launching kernels, and a slowdown planted on it would
    cost several times the fraction it claims once replayed."""

    def __init__(self, inner: Any, fraction: float, device: Any) -> None:
        self.inner, self.fraction, self.device = inner, fraction, device
        self.spin_s: float | None = None

    def __getattr__(self, attr: str) -> Any:  # chunks, result, book: the inner call's
        return getattr(self.inner, attr)

    def __call__(self) -> Any:
        import torch

        if self.spin_s is None and not torch.cuda.is_current_stream_capturing():
            self.spin_s = self.fraction * _replay_seconds(self.inner, self.device)
        out = self.inner()
        if self.spin_s is None:
            raise RuntimeError("a planted prefill slowdown was captured before it was timed: "
                               "run the call once eagerly first (cuda_graphs.capture does)")
        gpu_spin(self.spin_s, self.device)
        return out


def _replay_seconds(call: Callable[[], Any], device: Any) -> float:
    """GPU seconds of ``call`` as a CUDA graph replay, timed as a planted op slowdown times its
    call (``slowdown.gpu_seconds``: median of three, events around each)."""
    from pytest_dflash.measure import cuda_graphs

    captured = cuda_graphs.capture([call], device, warmup=1)
    seconds = gpu_seconds(captured.replays[0], device)
    del captured
    cuda_graphs.release(device)
    return seconds


def build(config: pytest.Config | WorkerContext, selection: dict[str, str], profile: str,
          planted: dict[str, Planted],
          policy: Any) -> Any:
    """The engine of ``selection`` if it names an engine-level planted route, else None (an
    op-level planted route is served by its wrapper inside an ordinary engine).

    The served selection (planted route replaced by the route whose code serves it) is built
    through the same hook, so whatever engine the session uses is the one wrapped.
    """

    def served_engine(served: dict[str, str]) -> Any:
        return config.hook.pytest_dflash_engine(config=config, selection=served, profile=profile)

    return wrap(selection, planted, policy, served_engine)


def wrap(selection: dict[str, str], planted: dict[str, Planted], policy: Any,
         served_engine: Callable[[dict[str, str]], Any]) -> EngineSelftest | None:
    """The planted route's engine of ``selection`` over ``served_engine(served selection)``, or
    None when ``selection`` names no engine-level planted route.

    One function for the gate's process (through the engine hook) and a timing worker (through
    its own engine factory), so a planted copy is the same engine wherever it is timed.
    """
    mine = [planted[name] for name in selection.values()
            if name in planted and planted[name].engine_level]
    if not mine:
        return None
    if len(mine) > 1:
        raise ValueError(f"one engine cannot carry two planted routes: {[p.name for p in mine]}")
    served = {family: planted[name].serves.name if name in planted else name
              for family, name in selection.items()}
    inner = served_engine(served)
    if inner is None:
        raise RuntimeError(f"no pytest_dflash_engine implementation built an engine for {served}")
    return EngineSelftest(inner, mine[0], selection, policy)


def unwrapped(engine: Engine) -> Engine:
    """The engine a planted route's engine runs on (``engine`` itself for any other): a timing
    worker that registers the planted routes rebuilds the planted engine when it can rebuild
    that one."""
    return engine.inner if isinstance(engine, EngineSelftest) else engine
