"""An engine for any local Hugging Face causal LM (docs/engines.md, "Hugging Face transformers").

Selected with ``--dflash-engine hf:PATH`` (ini ``dflash_engine``); ``--dflash-engine hf`` runs
the tiny Qwen3.5-architecture hybrid the package ships (``dflash_fixtures/qwen35_model``, made
by ``python -m dflash_fixtures.train_qwen35``), on which every shipped family applies. Optional
extra ``[hf]``: transformers, tokenizers, safetensors; a quantized KV cache also needs a backend
(``optimum-quanto``).

How it runs the protocol of ``pytest_dflash.engines``:

- ``encode``: the model's own tokenizer; ``add_special_tokens`` adds BOS exactly when the
  model's tokenizer does;
- ``score``: the model's full logits, the prompt fed in the geometry's chunks over the cache
  (``cache=``, as the prefill does), log-softmax in fp32;
- ``prefill``: the same chunked forward, timed (device synchronised), the first token's full
  logits hashed; the cache it leaves is the prefix ``verify`` runs on;
- ``generate``: ``model.generate()`` on the route's cache, greedy unless the sampling asks
  otherwise, stopped by a stopping criterion that matches the stop strings in the completion;
- ``verify``: one forward of M <= 8 draft tokens over a deep copy of the cached prefix (a
  recurrent layer keeps only its final state: there is no per-token rollback);
- ``route_hits``: what ran inside the model's layers, counted there: attention calls per layer
  (``transformers_attention``), MLP calls per M branch (``transformers_mlp``), prefill chunks,
  and the hits the routes' kernels recorded themselves while this engine ran (``route/op``).

Every shipped family is applied through transformers' own extension points, with no copy of
its modelling code:

- ``attn.d256``: the route is registered as a transformers attention function with its mask
  function (:mod:`pytest_dflash.engines.transformers_attention`); a model whose attention head
  dim is not 256 runs transformers' own ``sdpa`` and cannot take an attn.d256 candidate;
- ``gemm.nvfp4``: every gated MLP is quantized once to NVFP4 and served by the route's GEMM
  (:mod:`pytest_dflash.engines.transformers_mlp`); the baseline runs the same codes;
- ``prefill.geometry``: the chunk size, and the storage dtype of recurrent states between
  chunks through the cache (:mod:`pytest_dflash.engines.transformers_cache`);
- ``linear.gdn`` and ``norm_mlp`` (the kernel libraries' families): the gated delta rule at
  transformers' own gated-DeltaNet dispatch point while this engine runs, the gated norm and
  Liger's RMSNorm as patched modules of this model
  (:mod:`pytest_dflash.engines.transformers_library`).

The ``prefill.geometry.hf_*`` routes (registered only while this engine is selected:
:data:`ROUTES`) switch further transformers settings: attention implementation (eager against
the route's), compute dtype, chunk size and KV-cache implementation (static, quantized).
transformers and torch are imported only when an engine is built.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from pytest_dflash.routes.vocabulary import DTYPES

if TYPE_CHECKING:
    from pytest_dflash.routes.registry import RouteRegistry

ATTN, GEMM, GEOMETRY = "attn.d256", "gemm.nvfp4", "prefill.geometry"
GDN, NORM_MLP = "linear.gdn", "norm_mlp"  # the kernel libraries' families (routes/library.py)
BASELINE = f"{GEOMETRY}.fp32_q3296"
MAX_VERIFY_ROWS = 8
ATTENTION = ("sdpa", "eager")
# storage dtypes of recurrent states between chunks (the layers compute in fp32 either way)
STATE_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")
CACHES = ("dynamic", "static", "quantized")
ENGINE_NAME = "hf"
INSTALL_HINT = "pip install 'pytest-dflash[hf]'"


def default_model_dir() -> Path:
    """The tiny Qwen3.5-architecture model the package ships (``dflash_fixtures/qwen35_model``):
    gated-DeltaNet layers beside full attention of head dim 256, so every shipped family applies
    in it."""
    import dflash_fixtures

    return Path(dflash_fixtures.__file__).resolve().parent / "qwen35_model"


def llama_model_dir() -> Path:
    """The tiny Llama-architecture model the package ships (``dflash_fixtures/hf_model``), the
    one llama.cpp can convert and serve; its attention head dim (32) takes no attn.d256 route."""
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
    ``PrefillGeometry``: ``chunk(profile)`` and ``state_dtype``, the storage dtype of a hybrid
    model's recurrent states between chunks)."""

    name: str
    full_chunk: int = 3296
    attn_implementation: str = "sdpa"
    dtype: str = ""  # "": the session's compute dtype (--dflash-dtype, default float32)
    cache: str = "dynamic"
    cache_backend: str = ""
    cache_nbits: int = 0
    state: str = "float32"

    def __post_init__(self) -> None:
        if self.attn_implementation not in ATTENTION:
            raise ValueError(
                f"{self.name}: attention {self.attn_implementation!r} is not one of {ATTENTION}"
            )
        if self.dtype and self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not one of {DTYPES}")
        if self.cache not in CACHES:
            raise ValueError(f"{self.name}: cache {self.cache!r} is not one of {CACHES}")
        if self.state not in STATE_DTYPES:
            raise ValueError(f"{self.name}: state {self.state!r} is not one of {STATE_DTYPES}")
        if (self.cache == "quantized") != bool(self.cache_backend and self.cache_nbits):
            raise ValueError(
                f"{self.name}: a quantized cache needs cache_backend and "
                "cache_nbits, other caches neither"
            )

    @property
    def state_dtype(self) -> Any:
        import torch

        return getattr(torch, self.state)

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
    _route("EAGER", ("ppl", "quality", "prefill"), "transformers eager attention (baseline sdpa)"),
    _route("BF16", ("ppl", "quality", "prefill"), "compute in bfloat16 (baseline float32)"),
    _route("Q824", ("ppl", "prefill"), "prefill chunks a quarter of the baseline's"),
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


def pytest_dflash_routes(registry: RouteRegistry) -> None:
    """Register :data:`ROUTES` and the kernel libraries' candidate routes
    (``pytest_dflash.routes.library.CANDIDATES``). This module is registered as a plugin only
    while the transformers engine is selected, so the reference engine never faces them."""
    from pytest_dflash.routes import library

    for route in ROUTES:
        registry.register(route)
    library.register_candidates(registry)


def default_registry() -> Any:
    """The shipped routes plus :data:`ROUTES`: what an engine built outside a pytest session
    (``build(..., registry=None)``) resolves route names against."""
    from pytest_dflash.routes import library, shipped
    from pytest_dflash.routes.registry import RouteRegistry

    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    library.pytest_dflash_routes(registry)
    pytest_dflash_routes(registry)
    registry.validate()
    return registry


def settings_for(selection: Mapping[str, str], registry: RouteRegistry) -> tuple[str, HFSettings]:
    """The ``prefill.geometry`` route of ``selection`` as transformers settings."""
    from pytest_dflash.engines.geometry import Geometry

    name = selection.get(GEOMETRY, BASELINE)
    impl = registry.get(name).implementation()
    if isinstance(impl, HFSettings):
        return name, impl
    if isinstance(impl, Geometry):
        state = str(impl.state_dtype).removeprefix("torch.")
        if state not in STATE_DTYPES:
            raise EngineUnsupported(
                f"route {name} stores recurrent states in {state}; the transformers engine "
                f"stores them in one of {', '.join(STATE_DTYPES)}")
        return name, HFSettings(name, full_chunk=impl.full_chunk, state=state)
    raise EngineUnsupported(
        f"route {name}: its implementation {impl!r:.80} is neither a "
        "prefill geometry nor pytest_dflash.engines.transformers.HFSettings"
    )


def route_objects(selection: Mapping[str, str],
                  registry: RouteRegistry) -> dict[str, tuple[str, Any]]:
    """family -> (route name, route object) for attn.d256 and gemm.nvfp4 (baselines where the
    selection names none), each checked against its family contract."""
    out = {}
    for family in (ATTN, GEMM):
        name = selection.get(family) or registry.role(family, "baseline").name
        route = registry.get(name)
        if route.family != family:
            raise EngineError(f"selection maps family {family!r} to route {name!r} of family "
                              f"{route.family!r}; map each family to one of its own routes")
        try:
            impl = registry.family_of(family).check(route.implementation(), name)
        except TypeError as exc:
            raise EngineError(str(exc)) from None
        out[family] = (name, impl)
    return out


def library_route(selection: Mapping[str, str], registry: RouteRegistry,
                  family: str) -> tuple[str, Any] | None:
    """(route name, implementation) of a library family (``linear.gdn``, ``norm_mlp``): the
    selection's route, else the family's baseline; None where the registry has no such family
    (an engine built from a registry without the library families)."""
    if family not in registry.families():
        return None
    name = selection.get(family) or registry.role(family, "baseline").name
    route = registry.get(name)
    if route.family != family:
        raise EngineError(f"selection maps family {family!r} to route {name!r} of family "
                          f"{route.family!r}; map each family to one of its own routes")
    try:
        return name, registry.family_of(family).check(route.implementation(), name)
    except TypeError as exc:
        raise EngineError(str(exc)) from None


class TransformersEngine:
    """In-process engine over a local transformers causal LM: see the module docstring."""

    capabilities = IN_PROCESS  # full logits, verify on the cached prefix, own hits, timing

    def __init__(
        self,
        model_path: str | Path,
        selection: Mapping[str, str],
        profile: str,
        device: str = "cpu",
        registry: RouteRegistry | None = None,
        dtype: str | None = None,
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
        registry = registry or default_registry()
        self.route, self.settings = settings_for(selection, registry)
        routes = route_objects(selection, registry)
        self.attn_route, self.attn = routes[ATTN]
        self.gemm_route, self.gemm = routes[GEMM]
        self.selection = {**dict(selection), GEOMETRY: self.route, ATTN: self.attn_route,
                          GEMM: self.gemm_route}
        self.chunk = self.settings.chunk(profile)
        # the geometry route's own dtype (hf_bf16), else the session's on both sides
        self.dtype = self.settings.dtype or dtype or "float32"
        if self.dtype not in DTYPES:
            raise EngineError(f"compute dtype {self.dtype!r} is not one of {DTYPES}: pass "
                              f"--dflash-dtype {' | '.join(DTYPES)}")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        attention = self._attention_choice(registry)
        self.model = (
            AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype),
                                                 attn_implementation=attention)
            .to(self.device)
            .eval()
        )
        ran = getattr(self.model.config, "_attn_implementation", None)
        if ran != attention:
            raise EngineError(
                f"{self.route}: asked transformers for attention {attention!r}, the model "
                f"runs {ran!r}"
            )
        from pytest_dflash.engines.transformers_attention import served_by
        from pytest_dflash.engines.transformers_mlp import quantize_mlps

        self.attention_served_by = served_by(attention) or attention
        # a norm_mlp route that serves the checkpoint's MLPs (liger_swiglu and its baseline)
        # leaves them unquantized; everywhere else gemm.nvfp4 serves them
        self.mlps = (self._switch_libraries(selection, registry)
                     or quantize_mlps(self.model, self.gemm_route, self.gemm))
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
        self._kernel: Counter[str] = Counter()
        self._depth = 0

    def _attention_choice(self, registry: RouteRegistry) -> str:
        """The ``attn_implementation`` the model is loaded with: the attn.d256 route's function
        for a model with head dim 256, transformers' own otherwise (then only the family's
        baseline can be selected) and for a geometry route that asks for eager attention."""
        from transformers import AutoConfig

        from pytest_dflash.engines.transformers_attention import HEAD_DIM, register

        config = AutoConfig.from_pretrained(self.path)
        config = getattr(config, "text_config", None) or config
        if self.settings.state != "float32" and "linear_attention" not in (
                getattr(config, "layer_types", None) or ()):
            raise EngineUnsupported(
                f"route {self.route} stores recurrent states in {self.settings.state}; "
                f"{self.path.name} has no recurrent (SSM) state, so the route cannot be "
                "applied: gate it on a hybrid model (the default --dflash-engine hf model)")
        layer_types = set(getattr(config, "layer_types", None) or ())
        if self.settings.cache == "quantized" and layer_types - {"full_attention"}:
            raise EngineUnsupported(
                f"route {self.route} cannot be applied in {self.path.name}: transformers' "
                f"QuantizedCache holds full-attention layers only, and this model also has "
                f"{', '.join(sorted(layer_types - {'full_attention'}))} layers; gate it on a "
                "model with only full-attention layers (e.g. --dflash-engine hf:PATH of a "
                "Llama-style model)")
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        baseline = registry.role(ATTN, "baseline").name
        own = self.settings.attn_implementation != "sdpa"  # an hf_* route asks for eager
        if head_dim == HEAD_DIM and not own:
            return register(self.attn_route, self.attn)
        if self.attn_route != baseline:
            why = (f"its attention head dim is {head_dim}, family {ATTN} serves {HEAD_DIM}"
                   if head_dim != HEAD_DIM else
                   f"route {self.route} runs transformers' {self.settings.attn_implementation}")
            raise EngineUnsupported(
                f"route {self.attn_route} cannot be applied in {self.path.name}: {why}; gate it "
                "on a model with head dim 256 (the default --dflash-engine hf model) or with "
                "the reference engine")
        return self.settings.attn_implementation

    def _switch_libraries(self, selection: Mapping[str, str], registry: RouteRegistry) -> int:
        """The library families' routes inside this model: ``linear.gdn`` at transformers'
        gated-DeltaNet dispatch points while this engine runs, ``norm_mlp`` through Liger's
        patch of this model's modules (``pytest_dflash.engines.transformers_library``).
        Returns how many gated MLPs the norm_mlp route serves in the checkpoint's weights
        (0: gemm.nvfp4 serves them)."""
        from pytest_dflash.engines.transformers_library import (
            GdnSwitch,
            apply_liger,
            serve_checkpoint_mlps,
        )
        from pytest_dflash.library.norm_mlp import liger_parts

        self.gdn: Any = None
        gdn = library_route(selection, registry, GDN)
        if gdn is not None:
            self.gdn = GdnSwitch(self.model, gdn[0], gdn[1], registry.role(GDN, "baseline").name)
            self.selection[GDN] = gdn[0]
        norm = library_route(selection, registry, NORM_MLP)
        if norm is None:
            return 0
        self.selection[NORM_MLP] = norm[0]
        parts = liger_parts(norm[1])
        checkpoint = bool(getattr(norm[1], "checkpoint_mlps", False))
        if parts["swiglu"] and not checkpoint:
            raise EngineUnsupported(
                f"route {norm[0]} swaps the gated MLPs' SiLU-mul, which gemm.nvfp4 fuses into "
                "its gate_up here; a route that swaps it must serve the checkpoint's MLPs "
                "(checkpoint_mlps = True) and name a baseline that does too")
        if parts["rms_norm"] or parts["swiglu"]:
            apply_liger(self.model, norm[0], **parts)
        if not checkpoint:
            return 0
        if self.gemm_route != registry.role(GEMM, "baseline").name:
            raise EngineUnsupported(
                f"route {norm[0]} serves the checkpoint's gated MLPs, so {self.gemm_route} has "
                f"no MLP to serve in this engine: gate {self.gemm_route} and {norm[0]} in "
                "separate runs")
        # Liger's route runs Liger's MLP forward; another that owns the SiLU-mul calls it
        own = "swiglu" in getattr(norm[1], "own", ()) and not parts["swiglu"]
        return serve_checkpoint_mlps(self.model, norm[0], norm[1].swiglu if own else None)

    # ------------------------------------------------------------------------- helpers
    def _new_cache(self, max_len: int) -> Any:
        from transformers import QuantizedCache, StaticCache

        from pytest_dflash.engines.transformers_cache import geometry_cache

        if self.settings.cache == "static":
            return StaticCache(config=self.model.config, max_cache_len=max_len)
        if self.settings.cache == "quantized":
            return QuantizedCache(
                self.settings.cache_backend,
                config=self.model.config,
                nbits=self.settings.cache_nbits,
            )
        return geometry_cache(self.model.config, self.settings.state_dtype)

    @contextmanager
    def _tracked(self) -> Iterator[None]:
        """Collect the hits the routes' kernels record while this engine runs (outermost call
        only), as ``route/op``."""
        from pytest_dflash.native import hits

        self._depth += 1
        try:
            if self._depth > 1:
                yield
                return
            with hits.counting() as delta, self._gdn_installed():
                yield
            self._kernel.update({f"{r}/{op}": n for (r, op), n in delta.counts.items()})
        finally:
            self._depth -= 1

    def _gdn_installed(self) -> Any:
        """This engine's linear.gdn route at transformers' dispatch points while it runs."""
        from contextlib import nullcontext

        gdn = getattr(self, "gdn", None)
        return gdn.installed() if gdn is not None else nullcontext()

    def _hit(self, op: str, cache: Any) -> None:
        """One dispatch of this engine, with what really ran: the loaded model's attention
        implementation and dtype, and the cache object's class."""
        self._hits[self.route] += 1
        self._hits[f"{self.route}:{op}"] += 1
        self._hits[f"{self.route}:attn:{self.attention_served_by}"] += 1
        self._hits[f"{self.route}:dtype:{str(self.model.dtype).removeprefix('torch.')}"] += 1
        self._hits[f"{self.route}:cache:{type(cache).__name__}"] += 1
        from pytest_dflash.engines.transformers_cache import recurrent_state_dtypes

        for dtype in sorted(recurrent_state_dtypes(cache)):
            self._hits[f"{self.route}:state:{dtype}"] += 1

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
        with torch.inference_mode(), self._tracked():
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
        with torch.inference_mode(), self._tracked():
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

        The forward runs on a deep copy of the cached prefix, which stays as it was: a
        recurrent layer's cache keeps only its final state, so it cannot be cropped back. A
        static or quantized cache cannot be deep-copied (quanto's tensors refuse), so the
        prefix is prefilled again into a fresh one before the forward (untimed here: the
        prefill gates time ``prefill``)."""
        import torch

        ids = self._check_ids(draft_ids, "verify")
        if len(ids) > MAX_VERIFY_ROWS:
            raise EngineError(
                f"verify takes at most {MAX_VERIFY_ROWS} draft tokens, got {len(ids)}"
            )
        if self._cache is None:
            raise EngineError("verify needs a cached prefix: call prefill(prompt_ids) first")
        if self.settings.cache == "dynamic":
            cache = copy.deepcopy(self._cache)
        else:
            cache = self._new_cache(len(self._prefix) + MAX_VERIFY_ROWS)
            self._run_chunks(self._prefix, cache, all_logits=False)
        with torch.inference_mode(), self._tracked():
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                use_cache=True,
                logits_to_keep=0,
                **{self._cache_arg: cache},
            )
        self._hit("verify", cache)
        return out.logits[0].float()

    def reset_prefix_cache(self) -> None:
        """Drop the cached prefix: every prefill here is cold anyway (no prefix reuse)."""
        self._cache, self._prefix = None, []

    def route_hits(self) -> dict[str, int]:
        """Calls by route name counted inside the model's layers (attention per layer, MLP
        GEMMs per M branch, prefill chunks), ``route:op`` detail, what ran (attention function,
        dtype, cache class, recurrent-state dtype) and the kernels' own ``route/op`` hits."""
        from pytest_dflash.engines.transformers_attention import calls_of

        out: Counter[str] = Counter(self._hits)
        for (route, op), n in calls_of(self.model).items():
            out[route] += n
            out[f"{route}:{op}"] += n
        out.update(self._kernel)
        return dict(out)

    def __repr__(self) -> str:
        return (
            f"<TransformersEngine {self.path.name} {self.route} {self.attn_route} "
            f"{self.gemm_route} ({self.attention_served_by}, {self.dtype}, "
            f"{self.settings.cache} cache, {self.settings.state} state, chunk {self.chunk}) "
            f"device={self.device}>"
        )


def build(
    model_path: str | Path,
    selection: Mapping[str, str],
    profile: str,
    device: str = "cpu",
    registry: RouteRegistry | None = None,
    dtype: str | None = None,
) -> TransformersEngine:
    """The transformers engine of ``model_path`` for a family -> route selection, computing in
    ``dtype`` (``--dflash-dtype``; default float32) unless its geometry route sets one."""
    return TransformersEngine(model_path, selection, profile, device, registry, dtype)


def preload(model_path: str | Path) -> None:
    """Import transformers and the modelling code of ``model_path``'s architecture, and read
    its tokenizer once, without building a model.

    Why: a timing worker's first engine otherwise pays these imports (seconds) inside a gate,
    while the other workers wait, one after another; the pool starts its workers together, so
    paid at start they overlap (``timing_pool.TimingPool``). Nothing here touches a route."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if missing_library():
        return  # the engine's own build says why, naming the fix
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = check_model_dir(model_path)
    config = AutoConfig.from_pretrained(path)
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:  # else the engine's build names the problem
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # noqa: B018 - imports the modelling module
    AutoTokenizer.from_pretrained(path)
