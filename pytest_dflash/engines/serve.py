"""``pytest-dflash serve``: the reference engine behind a real OpenAI-compatible HTTP server.

So the server engine (``pytest_dflash.engines.openai_server``) is tested against a real server,
and so a deployment's gates can be rehearsed on a laptop, this serves the embedded reference
model the way vLLM serves a model: ``GET /health``, ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``POST /v1/completions`` (text or token-id prompts, ``echo``, ``logprobs``,
``prompt_logprobs``, ``stop``, ``seed``, ``stream``, ``return_token_ids``), plus
``POST /reset_prefix_cache`` and ``GET /dflash/route_hits`` (the server's own route counters).

Routes are selected exactly as a served stack selects them: by the enable switches in the
environment (``NAME=1``, the lines ``pytest-dflash enable`` prints). When the environment also
names the routes it meant to enable (``DFLASH_ROUTES``, set by the plugin), a switch this server
does not know is a startup error, never a silent fallback to the baseline.

FastAPI, pydantic and uvicorn are an optional extra (``pip install 'pytest-dflash[serve]'``);
this module is imported only by ``pytest-dflash serve``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from pytest_dflash.engines.openai_server import DEVICE_ENV, PROFILE_ENV, SELECTION_ENV
from pytest_dflash.routes.registry import RouteRegistry

if TYPE_CHECKING:
    from pytest_dflash.engines.reference import ReferenceEngine

MODEL_NAME = "dflash-reference"
MAX_MODEL_LEN = 131072  # no positional limit in the model; above the full profile's prompts
ON, OFF = frozenset({"1", "true", "yes", "on"}), frozenset({"", "0", "false", "no", "off"})


class ServeError(ValueError):
    """A server that cannot start as asked; the message says what to change."""


def build_registry(plugins: list[str]) -> RouteRegistry:
    """Shipped routes plus those of each ``--plugin`` module's ``pytest_dflash_routes``."""
    from pytest_dflash.routes import shipped
    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # plugin modules next to the project, as with pytest -p
    for name in plugins:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ServeError(f"--plugin {name}: cannot import it ({exc})") from None
        hook = getattr(module, "pytest_dflash_routes", None)
        if not callable(hook):
            raise ServeError(f"--plugin {name} has no pytest_dflash_routes(registry) function")
        hook(registry)
    registry.validate()
    return registry


def selection_from_env(registry: RouteRegistry, env: Mapping[str, str]) -> dict[str, str]:
    """Family -> route from the enable switches in ``env`` (baselines where none is on)."""
    enabled = []
    for route in registry.candidates():
        value = env.get(route.enable_switch)
        if value is None or value.strip().lower() in OFF:
            continue
        if value.strip().lower() not in ON:
            raise ServeError(f"{route.enable_switch}={value!r}: use 1 to enable {route.name} "
                             "or 0 to leave it off")
        enabled.append(route)
    families: dict[str, str] = {}
    for route in enabled:
        if route.family in families:
            raise ServeError(f"two routes of family {route.family} are switched on: "
                             f"{families[route.family]} and {route.name}; enable one")
        families[route.family] = route.name
    expected = env.get(SELECTION_ENV)
    if expected is not None:
        wanted = {n for n in expected.split(",") if n}
        unknown = sorted(n for n in wanted if n not in registry)
        if unknown:
            raise ServeError(f"{SELECTION_ENV} names routes this server does not know: "
                             f"{', '.join(unknown)}; register them with --plugin MODULE "
                             f"(known candidates: "
                             f"{', '.join(r.name for r in registry.candidates())})")
        if wanted != {r.name for r in enabled}:
            raise ServeError(f"{SELECTION_ENV} asks for {sorted(wanted)} but the switches "
                             f"enable {sorted(r.name for r in enabled)}")
    return registry.engine_selection([r.name for r in enabled])


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True

class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]

class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False


class Served:
    """The engine, its lock (one request at a time: the engine keeps state) and its name."""

    def __init__(self, engine: ReferenceEngine, registry: RouteRegistry, name: str, profile: str,
                 device: str) -> None:
        self.engine, self.registry, self.name = engine, registry, name
        self.profile, self.device = profile, device
        self.lock = threading.Lock()
        self.created = int(time.time())


def _token_text(token: int) -> str:
    from pytest_dflash.engines.tokenizer import BOS, EOS, decode

    return {BOS: "<bos>", EOS: "<eos>"}.get(token) or decode([token])


def _key(token: int, as_ids: bool) -> str:
    return f"token_id:{token}" if as_ids else _token_text(token)


def completion_logprobs(ids: list[int], scored: tuple[list[float], list[int], list[dict]],
                        first_scored: int, as_ids: bool) -> dict[str, Any]:
    """OpenAI ``logprobs`` of ``ids[first_scored:]`` (the first token of a sequence has none)."""
    chosen, _, top = scored
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, Any] | None] = []
    offsets: list[int] = []
    offset = 0
    for pos in range(first_scored, len(ids)):
        text = _key(ids[pos], as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos == 0:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(chosen[pos - 1])
        entry = {_key(t, as_ids): lp for t, lp in top[pos - 1].items()}
        entry[_key(ids[pos], as_ids)] = chosen[pos - 1]
        top_logprobs.append(entry)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs(ids: list[int], scored: tuple[list[float], list[int], list[dict]]
                    ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token id its log-prob,
    rank and text (the scored token plus the top k)."""
    chosen, ranks, top = scored
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for pos in range(1, len(ids)):
        entry = {str(t): {"logprob": lp, "rank": r + 1, "decoded_token": _token_text(t)}
                 for r, (t, lp) in enumerate(sorted(top[pos - 1].items(), key=lambda kv: -kv[1]))}
        entry[str(ids[pos])] = {"logprob": chosen[pos - 1], "rank": ranks[pos - 1],
                                "decoded_token": _token_text(ids[pos])}
        out.append(entry)
    return out


def create_app(served: Served) -> Any:
    """The FastAPI application (see the module docstring for the endpoints)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import JSONResponse, StreamingResponse

    from pytest_dflash.engines import Sampling
    from pytest_dflash.engines.tokenizer import EOS, decode, encode

    engine = served.engine
    app = FastAPI(title="pytest-dflash reference engine")

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise HTTPException(404, f"model {name!r} is not served here; this server serves "
                                     f"{served.name!r}")

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        from pytest_dflash.engines.openai_server import enabled_routes

        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": served.created,
            "owned_by": "pytest-dflash", "max_model_len": MAX_MODEL_LEN,
            "dflash": {"selection": dict(engine.selection), "profile": served.profile,
                       "device": served.device,
                       "enabled_routes": enabled_routes(engine.selection, served.registry)},
        }]}

    @app.post("/tokenize")
    def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        tokens = encode(req.prompt, bos=req.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": MAX_MODEL_LEN}

    @app.post("/detokenize")
    def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        check_model(req.model)
        return {"prompt": decode(req.tokens)}

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict[str, str]:
        with served.lock:
            engine.reset_prefix_cache()
        return {"status": "ok"}

    @app.get("/dflash/route_hits")
    def route_hits() -> dict[str, int]:
        with served.lock:
            return dict(engine.route_hits())

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> Any:
        check_model(req.model)
        ids = list(req.prompt) if isinstance(req.prompt, list) else encode(req.prompt, bos=True)
        if not ids:
            raise HTTPException(400, "the prompt is empty")
        if req.max_tokens == 0 and not req.echo:
            raise HTTPException(400, "max_tokens=0 returns nothing without echo=true")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        try:
            with served.lock:
                choice = _complete(ids, req, stops)
        except ValueError as exc:  # the engine's own clear refusals (bad ids, bad sampling)
            raise HTTPException(400, str(exc)) from None
        usage = {"prompt_tokens": len(ids), "completion_tokens": choice.pop("_generated"),
                 "total_tokens": len(ids)}
        usage["total_tokens"] += usage["completion_tokens"]
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": served.name, "choices": [choice],
                "usage": usage}
        if not req.stream:
            return JSONResponse(body)

        def events():  # computed before the first byte: time to first token = whole request
            yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _complete(ids: list[int], req: CompletionRequest, stops: list[str]) -> dict[str, Any]:
        text, out, reason, stop_reason = "", [], "length", None
        if req.max_tokens > 0:
            gen = engine.generate_ids(ids, req.max_tokens, stops,
                                      Sampling(req.temperature, req.top_p, req.seed or 0))
            text, out, reason = gen.text, list(gen.token_ids), gen.finish_reason
            full = decode(out)
            stop_reason = next((s for s in stops if full.startswith(text + s)), None)
            if reason == "stop" and stop_reason is None:
                out.append(EOS)  # as vLLM does: the EOS that ended it is an output token
        else:
            engine._check_ids(ids, "prompt")
        sequence = ids + out
        want_top = max(req.logprobs or 0, req.prompt_logprobs or 0, 1)
        scored = (engine.score_top(sequence, want_top)
                  if (req.logprobs is not None or req.prompt_logprobs is not None)
                  and len(sequence) >= 2 else ([], [], []))
        choice: dict[str, Any] = {"index": 0, "text": (decode(ids) if req.echo else "") + text,
                                  "logprobs": None, "finish_reason": reason,
                                  "stop_reason": stop_reason, "_generated": len(out)}
        if req.logprobs is not None:
            first = 0 if req.echo else len(ids)
            choice["logprobs"] = completion_logprobs(sequence, _trim(scored, req.logprobs),
                                                     first, req.return_tokens_as_token_ids)
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(
                ids, _trim(scored, req.prompt_logprobs))
        if req.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = out, ids
        return choice

    app.state.served = served
    return app


def _trim(scored: tuple[list[float], list[int], list[dict]], k: int
          ) -> tuple[list[float], list[int], list[dict]]:
    chosen, ranks, top = scored
    return chosen, ranks, [dict(sorted(t.items(), key=lambda kv: -kv[1])[:k]) for t in top]


def serve(host: str, port: int, profile: str | None, device: str | None, plugins: list[str],
          model_name: str = MODEL_NAME, log_level: str = "warning") -> None:
    """Build the engine for the switches in the environment, then serve it until stopped."""
    import uvicorn

    from pytest_dflash.engines import reference
    from pytest_dflash.routes.vocabulary import PROFILES

    profile = profile or os.environ.get(PROFILE_ENV) or "ci"
    if profile not in PROFILES:
        raise ServeError(f"profile {profile!r}: use {', '.join(PROFILES)}")
    device = device or os.environ.get(DEVICE_ENV) or "cpu"
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    registry = build_registry(plugins)
    selection = selection_from_env(registry, os.environ)
    engine = reference.build(selection, profile, device=device, registry=registry)
    served = Served(engine, registry, model_name, profile, device)
    print(f"pytest-dflash serve: {model_name} on http://{host}:{port}, profile {profile}, "
          f"device {device}, routes {engine.selection}", flush=True)
    uvicorn.run(create_app(served), host=host, port=port, log_level=log_level)
