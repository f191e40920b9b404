"""An engine for any local Hugging Face causal LM (docs/engines.md, "Hugging Face transformers").

Selected with ``--dflash-engine hf:PATH`` (ini ``dflash_engine``); ``--dflash-engine hf`` runs
the tiny Llama-architecture model the package ships (``dflash_fixtures/hf_model``, made by
``python -m dflash_fixtures.train_hf``). Optional extra ``[hf]``: transformers, tokenizers,
safetensors; a quantized KV cache also needs a backend (``optimum-quanto``).

How it runs the protocol of ``pytest_dflash.engines``:

- ``encode``: the model's own tokenizer; ``add_special_tokens`` adds BOS exactly when the
  model's tokenizer does;
- ``score``: the model's full logits, the prompt fed in the geometry's chunks over
  ``past_key_values`` (as the prefill does), log-softmax in fp32;
- ``prefill``: the same chunked forward, timed (device synchronised), the first token's full
  logits hashed; the cache it leaves is the prefix ``verify`` runs on;
- ``generate``: ``model.generate()`` on the route's KV cache, greedy unless the sampling asks
  otherwise, stopped by a stopping criterion that matches the stop strings in the completion;
- ``verify``: one forward of M <= 8 draft tokens over a copy of the cached prefix;
- ``route_hits``: this engine's own dispatches, named by the geometry route that served them,
  with the attention implementation, compute dtype and cache class the model really ran
  (read back from the loaded model and the cache object, not from the request).

Routes are those of family ``prefill.geometry``: the shipped fp32 geometries set the prefill
chunk size, and the ``prefill.geometry.hf_*`` routes (registered only while this engine is
selected: :data:`ROUTES`) switch real transformers settings: attention implementation (eager
against sdpa), compute dtype, chunk size and KV-cache implementation (static, quantized).
Routes of other families (the reference model's attention and NVFP4 kernels) cannot be switched
in a transformers model: asking for one is an :class:`~pytest_dflash.engines.EngineUnsupported`
naming the route. transformers and torch are imported only when an engine is built.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_dflash.engines import (
    IN_PROCESS,
    EngineError,
    EngineUnsupported,
    Generation,
    PrefillResult,
    Sampling,
    check_positions,
)
from pytest_dflash.routes.registry import Route

GEOMETRY = "prefill.geometry"
BASELINE = f"{GEOMETRY}.fp32_q3296"
MAX_VERIFY_ROWS = 8
ATTENTION = ("sdpa", "eager")
DTYPES = ("float32", "bfloat16", "float16")
CACHES = ("dynamic", "static", "quantized")
ENGINE_NAME = "hf"
INSTALL_HINT = "pip install 'pytest-dflash[hf]'"


def default_model_dir() -> Path:
    """The tiny Llama-architecture model the package ships (``dflash_fixtures/hf_model``)."""
    import dflash_fixtures

    return Path(dflash_fixtures.__file__).resolve().parent / "hf_model"


def missing_library() -> str | None:
    """Why the engine cannot run here (transformers or tokenizers missing), None if it can."""
    import importlib.util

    absent = [
        m
        for m in ("transformers", "tokenizers", "safetensors")
        if importlib.util.find_spec(m) is None
    ]
    if absent:
        return f"{', '.join(absent)} not installed: {INSTALL_HINT}"
    return None


def check_model_dir(path: str | Path) -> Path:
    """``path`` must be a local transformers model directory (config.json and a tokenizer)."""
    model = Path(path).expanduser()
    if not model.is_dir():
        raise EngineError(
            f"--dflash-engine hf:{path}: no such directory; give a local "
            "Hugging Face model directory (config.json, weights, tokenizer)"
        )
    if not (model / "config.json").is_file():
        raise EngineError(
            f"--dflash-engine hf:{path}: no config.json there; give the directory "
            "save_pretrained() wrote"
        )
    if not any((model / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise EngineError(
            f"--dflash-engine hf:{path}: no tokenizer files there; save the "
            "model's tokenizer next to it (tokenizer.save_pretrained(PATH))"
        )
    return model.resolve()


def quanto_missing() -> str | None:
    """Probe of the quantized-cache routes: the optimum-quanto backend must be installed."""
    import importlib.util

    if (
        importlib.util.find_spec("optimum") is None
        or importlib.util.find_spec("optimum.quanto") is None
    ):
        return "the quantized KV cache needs optimum-quanto: pip install optimum-quanto"
    return None


@dataclass(frozen=True)
class HFSettings:
    """What one ``prefill.geometry`` route sets in the transformers engine (the family contract
    ``PrefillGeometry``: ``chunk(profile)`` and ``state_dtype``, the latter always fp32 here:
    a transformer has no SSM state)."""

    name: str
    full_chunk: int = 3296
    attn_implementation: str = "sdpa"
    dtype: str = "float32"
    cache: str = "dynamic"
    cache_backend: str = ""
    cache_nbits: int = 0

    def __post_init__(self) -> None:
        if self.attn_implementation not in ATTENTION:
            raise ValueError(
                f"{self.name}: attention {self.attn_implementation!r} is not one of {ATTENTION}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.cache not in CACHES:
            raise ValueError(f"{self.name}: cache {self.cache!r} is not one of {CACHES}")
        if (self.cache == "quantized") != bool(self.cache_backend and self.cache_nbits):
            raise ValueError(
                f"{self.name}: a quantized cache needs cache_backend and "
                "cache_nbits, other caches neither"
            )

    @property
    def state_dtype(self) -> Any:
        import torch

        return torch.float32

    def chunk(self, profile: str) -> int:
        """Prefill chunk size for ``profile`` (the shipped geometries' divisors)."""
        from pytest_dflash.engines.geometry import PROFILE_DIVISOR

        if profile not in PROFILE_DIVISOR:
            raise ValueError(
                f"unknown profile {profile!r} for {self.name}; known: {', '.join(PROFILE_DIVISOR)}"
            )
        return max(1, self.full_chunk // PROFILE_DIVISOR[profile])


_MOD = "pytest_dflash.engines.transformers"
EAGER = HFSettings(f"{GEOMETRY}.hf_eager", attn_implementation="eager")
BF16 = HFSettings(f"{GEOMETRY}.hf_bf16", dtype="bfloat16")
Q824 = HFSettings(f"{GEOMETRY}.hf_q824", full_chunk=824)
STATIC_CACHE = HFSettings(f"{GEOMETRY}.hf_static_cache", cache="static")
KV_QUANTO_INT4 = HFSettings(
    f"{GEOMETRY}.hf_kv_quanto_int4", cache="quantized", cache_backend="quanto", cache_nbits=4
)
KV_QUANTO_INT2 = HFSettings(
    f"{GEOMETRY}.hf_kv_quanto_int2", cache="quantized", cache_backend="quanto", cache_nbits=2
)


def _route(
    settings_attr: str, gates: tuple[str, ...], description: str, probe: str | None = None
) -> Route:
    settings = globals()[settings_attr]
    return Route(
        settings.name,
        GEOMETRY,
        "candidate",
        baseline=BASELINE,
        gates=gates,
        impl=f"{_MOD}:{settings_attr}",
        probe=probe,
        description=description,
    )


# Candidates of the transformers engine; their baseline is the family's (sdpa attention, the
# checkpoint in float32, a dynamic cache, chunks of 3296 / the profile's divisor).
ROUTES: tuple[Route, ...] = (
    _route("EAGER", ("ppl", "quality", "speed"), "transformers eager attention (baseline sdpa)"),
    _route("BF16", ("ppl", "quality", "speed"), "compute in bfloat16 (baseline float32)"),
    _route("Q824", ("ppl", "speed"), "prefill chunks a quarter of the baseline's"),
    _route("STATIC_CACHE", ("ppl", "quality"), "transformers StaticCache (baseline DynamicCache)"),
    _route(
        "KV_QUANTO_INT4",
        ("ppl", "quality"),
        "QuantizedCache, optimum-quanto int4",
        probe=f"{_MOD}:quanto_missing",
    ),
    _route(
        "KV_QUANTO_INT2",
        ("ppl", "quality"),
        "QuantizedCache, optimum-quanto int2",
        probe=f"{_MOD}:quanto_missing",
    ),
)


def pytest_dflash_routes(registry: Any) -> None:
    """Register :data:`ROUTES` (this module is registered as a plugin only while the
    transformers engine is selected, so the reference engine never faces them)."""
    for route in ROUTES:
        registry.register(route)


def default_registry() -> Any:
    """The shipped routes plus :data:`ROUTES`: what an engine built outside a pytest session
    (``build(..., registry=None)``) resolves route names against."""
    from pytest_dflash.routes import shipped
    from pytest_dflash.routes.registry import RouteRegistry

    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    pytest_dflash_routes(registry)
    registry.validate()
    return registry


def settings_for(selection: Mapping[str, str], registry: Any) -> tuple[str, HFSettings]:
    """The geometry route of ``selection`` as transformers settings; any other family switched
    away from its baseline is unsupported here (the engine runs the model's own layers)."""
    from pytest_dflash.engines.geometry import Geometry

    for family, name in selection.items():
        if family == GEOMETRY:
            continue
        baseline = registry.role(family, "baseline").name
        if name != baseline:
            raise EngineUnsupported(
                f"the transformers engine runs the model's own layers: route {name} of family "
                f"{family} cannot be switched in it (only {GEOMETRY} routes can); gate it with "
                "the reference engine (no --dflash-engine)"
            )
    name = selection.get(GEOMETRY, BASELINE)
    impl = registry.get(name).implementation()
    if isinstance(impl, HFSettings):
        return name, impl
    if isinstance(impl, Geometry):
        import torch

        if impl.state_dtype != torch.float32:
            raise EngineUnsupported(
                f"route {name} stores an SSM state in {impl.state_dtype}; a transformers model "
                "has no SSM state, so the route cannot be applied (select hf routes with "
                "--dflash-route prefill.geometry.hf_...)"
            )
        return name, HFSettings(name, full_chunk=impl.full_chunk)
    raise EngineUnsupported(
        f"route {name}: its implementation {impl!r:.80} is neither a "
        "prefill geometry nor pytest_dflash.engines.transformers.HFSettings"
    )


class TransformersEngine:
    """In-process engine over a local transformers causal LM: see the module docstring."""

    capabilities = IN_PROCESS  # full logits, verify on the cached prefix, own hits, timing

    def __init__(
        self,
        model_path: str | Path,
        selection: Mapping[str, str],
        profile: str,
        device: str = "cpu",
        registry: Any = None,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        reason = missing_library()
        if reason:
            raise EngineUnsupported(f"the transformers engine cannot run: {reason}")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = check_model_dir(model_path)
        self.profile = profile
        self.device = torch.device(device)
        self.route, self.settings = settings_for(selection, registry or default_registry())
        self.selection = {**dict(selection), GEOMETRY: self.route}
        self.chunk = self.settings.chunk(profile)
        dtype = getattr(torch, self.settings.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                self.path,
                dtype=dtype,
                attn_implementation=self.settings.attn_implementation,
            )
            .to(self.device)
            .eval()
        )
        ran = getattr(self.model.config, "_attn_implementation", None)
        if ran != self.settings.attn_implementation:
            raise EngineError(
                f"{self.route}: asked transformers for attention "
                f"{self.settings.attn_implementation!r}, the model runs {ran!r}"
            )
        # the cache argument's name: ``cache`` from transformers 5.x on, ``past_key_values``
        # before (the older name is deprecated there)
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.vocab = int(self.model.config.vocab_size)
        self.eos = self.tokenizer.eos_token_id
        self._cache: Any = None
        self._prefix: list[int] = []
        self._hits: Counter[str] = Counter()

    # ------------------------------------------------------------------------- helpers
    def _new_cache(self, max_len: int) -> Any:
        from transformers import DynamicCache, QuantizedCache, StaticCache

        if self.settings.cache == "static":
            return StaticCache(config=self.model.config, max_cache_len=max_len)
        if self.settings.cache == "quantized":
            return QuantizedCache(
                self.settings.cache_backend,
                config=self.model.config,
                nbits=self.settings.cache_nbits,
            )
        return DynamicCache(config=self.model.config)

    def _hit(self, op: str, cache: Any) -> None:
        """One dispatch of this engine, with what really ran: the loaded model's attention
        implementation and dtype, and the cache object's class."""
        cfg = self.model.config
        self._hits[self.route] += 1
        self._hits[f"{self.route}:{op}"] += 1
        self._hits[f"{self.route}:attn:{cfg._attn_implementation}"] += 1
        self._hits[f"{self.route}:dtype:{str(self.model.dtype).removeprefix('torch.')}"] += 1
        self._hits[f"{self.route}:cache:{type(cache).__name__}"] += 1

    def _check_ids(self, token_ids: list[int], what: str) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise EngineError(f"{what} needs at least one token id, got an empty list")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise EngineError(
                f"{what}: token ids {bad[:5]} are outside the vocabulary "
                f"0..{self.vocab - 1} of {self.path.name}"
            )
        return ids

    def _run_chunks(self, ids: list[int], cache: Any, all_logits: bool) -> tuple[list[Any], int]:
        import torch

        outs, chunks = [], 0
        with torch.inference_mode():
            for start in range(0, len(ids), self.chunk):
                piece = torch.tensor([ids[start : start + self.chunk]], device=self.device)
                out = self.model(
                    input_ids=piece,
                    use_cache=True,
                    logits_to_keep=0 if all_logits else 1,
                    **{self._cache_arg: cache},
                )
                outs.append(out.logits[0])
                chunks += 1
                self._hit("chunk", cache)
        return outs, chunks

    def _stop_in_completion(self, prompt_len: int, stop: list[str]) -> Any:
        """generate()'s stopping criterion for the stop strings, matched in the completion
        only: transformers' own ``stop_strings`` also match across the prompt's end (a prompt
        ending in a newline would stop at once on a completion starting with ``#`` for the
        stop string ``\n#``), which the other engines never do."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        tokenizer = self.tokenizer

        class StopInCompletion(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                text = tokenizer.decode(input_ids[0, prompt_len:], skip_special_tokens=True)
                return torch.tensor([any(s in text for s in stop)], device=input_ids.device)

        return StoppingCriteriaList([StopInCompletion()])

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------- protocol
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The model tokenizer's ids of ``text``; with ``add_special_tokens`` what the
        tokenizer puts around a prompt (its BOS, if the model has one)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def prefill(self, token_ids: list[int]) -> PrefillResult:
        """Prefill ``token_ids`` cold in chunks of ``self.chunk`` over a fresh cache (timed);
        keeps the cache as the prefix of ``verify``."""
        ids = self._check_ids(token_ids, "prefill")
        cache = self._new_cache(len(ids) + MAX_VERIFY_ROWS)
        self._sync()
        t0 = time.perf_counter()
        outs, chunks = self._run_chunks(ids, cache, all_logits=False)
        self._sync()
        seconds = time.perf_counter() - t0
        logits = outs[-1][-1].float().cpu()
        self._cache, self._prefix = cache, ids
        return PrefillResult(
            int(logits.argmax()),
            hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
            len(ids),
            seconds,
            chunks,
        )

    def prefill_logits(self, token_ids: list[int], positions: list[int]) -> Any:
        """Log-probs [len(positions), vocab] (fp64, on the CPU) of the next token after each of
        ``positions``, from one cold prefill in the route's chunks over a fresh cache, which then
        stays the prefix of ``verify``: what the cold-prefill agreement check compares."""
        import torch

        ids = self._check_ids(token_ids, "prefill_logits")
        where = check_positions(positions, len(ids), "prefill_logits")
        cache = self._new_cache(len(ids) + MAX_VERIFY_ROWS)
        outs, _ = self._run_chunks(ids, cache, all_logits=True)
        self._cache, self._prefix = cache, ids
        rows = torch.cat(outs)[torch.tensor(where, dtype=torch.long, device=self.device)]
        return torch.log_softmax(rows.double(), dim=-1).cpu()

    def score(self, token_ids: list[int]) -> list[float]:
        """log p(token i+1 | tokens 0..i) for every i, from all logits of a fresh cache."""
        import torch

        ids = self._check_ids(token_ids, "score")
        if len(ids) < 2:
            raise EngineError("score needs at least two token ids (e.g. BOS and one token)")
        outs, _ = self._run_chunks(ids, self._new_cache(len(ids)), all_logits=True)
        logp = torch.log_softmax(torch.cat(outs)[:-1].float(), dim=-1)
        target = torch.tensor(ids[1:], device=logp.device)
        return logp.gather(1, target[:, None])[:, 0].cpu().tolist()

    def generate(
        self,
        prompt: str,
        max_new_tokens: int,
        stop: list[str] | None = None,
        sampling: Sampling | None = None,
    ) -> Generation:
        """Complete ``prompt`` with ``model.generate()`` (the model's BOS, the route's cache);
        the text is cut at the first stop string."""
        import torch

        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or Sampling()
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
            raise EngineError(
                f"sampling needs temperature >= 0 and 0 < top_p <= 1, got "
                f"{sampling.temperature} and {sampling.top_p}"
            )
        stop = [s for s in (stop or []) if s]
        ids = self._check_ids(self.encode(prompt, add_special_tokens=True), "generate")
        cache = self._new_cache(len(ids) + max_new_tokens + 1)
        kwargs: dict[str, Any] = {"do_sample": False}
        if sampling.temperature > 0:
            torch.manual_seed(sampling.seed)
            kwargs = {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": 0,
            }
        if stop:
            kwargs["stopping_criteria"] = self._stop_in_completion(len(ids), stop)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=torch.tensor([ids], device=self.device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=self.device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=self.eos,
                **{self._cache_arg: cache},
                **kwargs,
            )
        self._hit("generate", cache)
        new = out[0, len(ids) :].tolist()
        finish = "length"
        if self.eos is not None and self.eos in new:
            new, finish = new[: new.index(self.eos)], "stop"
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        hit = [text.index(s) for s in stop if s in text]
        if hit:
            text, finish = text[: min(hit)], "stop"
        return Generation(text, new, finish)

    def verify(self, draft_ids: list[int]) -> Any:
        """Logits [M, vocab] of M <= 8 draft tokens in one forward over the cached prefix.

        The prefix is left as it was: a dynamic cache is cropped back to it afterwards; a
        static or quantized cache cannot be cropped (nor deep-copied: quanto's tensors refuse),
        so the prefix is prefilled again into a fresh cache before the forward (untimed here:
        the prefill gates time ``prefill``)."""
        import torch
        from transformers import DynamicCache

        ids = self._check_ids(draft_ids, "verify")
        if len(ids) > MAX_VERIFY_ROWS:
            raise EngineError(
                f"verify takes at most {MAX_VERIFY_ROWS} draft tokens, got {len(ids)}"
            )
        if self._cache is None:
            raise EngineError("verify needs a cached prefix: call prefill(prompt_ids) first")
        cache = self._cache
        if type(cache) is not DynamicCache:
            cache = self._new_cache(len(self._prefix) + MAX_VERIFY_ROWS)
            self._run_chunks(self._prefix, cache, all_logits=False)
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=True,
                logits_to_keep=0,
                **{self._cache_arg: cache},
            )
        if cache is self._cache:
            cache.crop(-len(ids))  # drop the draft rows again
        self._hit("verify", cache)
        return out.logits[0].float()

    def reset_prefix_cache(self) -> None:
        """Drop the cached prefix: every prefill here is cold anyway (no prefix reuse)."""
        self._cache, self._prefix = None, []

    def route_hits(self) -> dict[str, int]:
        """Dispatches by route name, plus ``route:op`` and what ran (attention, dtype, cache)."""
        return dict(self._hits)

    def __repr__(self) -> str:
        return (
            f"<TransformersEngine {self.path.name} {self.route} "
            f"({self.settings.attn_implementation}, {self.settings.dtype}, "
            f"{self.settings.cache} cache, chunk {self.chunk}) device={self.device}>"
        )


def build(
    model_path: str | Path,
    selection: Mapping[str, str],
    profile: str,
    device: str = "cpu",
    registry: Any = None,
) -> TransformersEngine:
    """The transformers engine of ``model_path`` for a family -> route selection."""
    return TransformersEngine(model_path, selection, profile, device, registry)
