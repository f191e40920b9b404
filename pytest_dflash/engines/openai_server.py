"""An engine over an OpenAI-compatible completions server (vLLM and the like).

The stacks this plugin serves measure prompt perplexity from their server's log-probs and coding
quality from its completions, so the model-level gates drive that same server:

- ``encode``: ``POST /tokenize`` (vLLM's endpoint; ``add_special_tokens`` adds the model's BOS);
- ``score``: ``POST /v1/completions`` with the prompt as token ids, ``echo``, ``logprobs=1`` and
  ``max_tokens=1`` (as lm-evaluation-harness's ``local-completions`` does); the echoed prompt's
  ``token_logprobs`` (the first is null: nothing predicts the first token) are the scores;
- ``generate``: ``POST /v1/completions`` with the text prompt, the policy's temperature, top_p and
  seed, at most :data:`STOP_LIMIT` stop strings (the OpenAI API's limit); the others are applied
  here, to the returned text, exactly as an engine applying them while decoding would;
  ``finish_reason`` ``stop``/``length`` is kept, anything else is an error;
- ``prefill``: a streamed completion of one token; the seconds are the time to the first token.

A server offers no full logits, no verify step on a cached prefix and no in-process route hits:
those capabilities are declared missing, so the gates needing them stay pending. The route proof
of a server is the set of enable switches it was started with, plus the counters it reports
itself (``GET /dflash/route_hits``, offered by ``pytest-dflash serve``) where it has them.

Servers are either started by the plugin (``--dflash-serve "CMD ... {port}"``, one server per
route selection, never two at once: :class:`ServerPool`) or run by the user
(``--dflash-engine-url KEY=URL``). ``httpx`` is an optional dependency (extra ``serve``).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_dflash.engines import (
    Capabilities,
    EngineUnsupported,
    Generation,
    PrefillResult,
    Sampling,
)
from pytest_dflash.routes import origin
from pytest_dflash.routes.registry import selection_key

if TYPE_CHECKING:
    from pytest_dflash.routes.registry import RouteRegistry

STOP_LIMIT = 4  # the OpenAI completions API takes at most four stop sequences
SELECTION_ENV = "DFLASH_ROUTES"  # names of the enabled routes, so a server can check its switches
PROFILE_ENV = "DFLASH_PROFILE"
DEVICE_ENV = "DFLASH_DEVICE"
LOG_TAIL_CHARS = 3000
COUNTERS_TIMEOUT_S = 10.0  # longest wait for a stopping server's route counters

SERVER_CAPABILITIES = Capabilities(
    prefill_timing=True,
    first_token_hash=False,
    verify_logits=False,
    route_hits=False,
    position_logits=False,
    reasons={
        "first_token_hash": "an OpenAI-compatible server returns top-k log-probs, not the full "
                            "logits a bitwise first-token hash needs",
        "verify_logits": "an OpenAI-compatible server has no verify step of M <= 8 draft rows "
                         "on a cached prefix",
        "position_logits": "an OpenAI-compatible server returns top-k prompt log-probs, not the "
                           "full next-token distributions the agreement check compares",
        "route_hits": "route hits are counted in the server's process; its proof is the enable "
                      "switches it was started with (and its own counters where it has them)",
    },
)


class ServerError(RuntimeError):
    """A server that exits, hangs, never becomes healthy or answers nonsense."""


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ServerError("the server engine needs httpx: pip install 'pytest-dflash[serve]'") \
            from None
    return httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on the loopback right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def apply_stops(text: str, stops: list[str]) -> tuple[str, bool]:
    """Cut ``text`` where a decoder checking ``stops`` after every character would have
    stopped: at the first position where some stop string is complete, cut before the
    earliest stop string present by then. Returns the text and whether a stop was hit."""
    ends = [text.find(s) + len(s) for s in stops if s and s in text]
    if not ends:
        return text, False
    seen = text[: min(ends)]
    return seen[: min(seen.index(s) for s in stops if s and s in seen)], True


# ------------------------------------------------------------------------- selections

def switches_for(selection: Mapping[str, str], registry: RouteRegistry) -> dict[str, str]:
    """``NAME=1`` for every non-baseline route in ``selection`` (what ``pytest-dflash enable``
    prints for accepted routes) plus each such route's ``server_env`` (the server's own
    settings, e.g. llama_cpp.server's ``N_UBATCH``), the switches of every other registered
    candidate absent. Two switched-on routes asking one setting for different values is an
    error naming both: the server could honour only one of them."""
    env: dict[str, str] = {}
    owner: dict[str, str] = {}
    for name in sorted(selection.values()):
        route = registry.get(name)
        if route.role != "candidate":
            continue
        for key, value in {route.enable_switch: "1", **route.server_env}.items():
            if key in env and env[key] != value:
                raise ValueError(f"routes {owner[key]} and {route.name} both set {key} "
                                 f"({env[key]!r} and {value!r}); switch on one of them")
            env[key], owner[key] = value, route.name
    return env


def enabled_routes(selection: Mapping[str, str], registry: RouteRegistry) -> list[str]:
    return sorted(n for n in selection.values() if registry.get(n).role == "candidate")


def server_env(selection: Mapping[str, str], registry: RouteRegistry, base: Mapping[str, str],
               profile: str | None = None, device: str | None = None) -> dict[str, str]:
    """The environment of a server for ``selection``: ``base`` without any registered route's
    switch (none leaks in from the caller's shell), then this selection's switches. The session
    builds ``base`` so that a server started by an xdist worker that owns a GPU sees that GPU
    only (``pytest_dflash.xdist.gpus.server_env``, docs/multi-gpu.md)."""
    env = dict(base)
    for route in registry:
        env.pop(route.enable_switch, None)
        for key in route.server_env:
            env.pop(key, None)
    env.update(switches_for(selection, registry))
    env[SELECTION_ENV] = ",".join(enabled_routes(selection, registry))
    if profile:
        env[PROFILE_ENV] = profile
    if device:
        env[DEVICE_ENV] = device
    return env


def parse_engine_urls(specs: list[str]) -> dict[str, str]:
    """``KEY=URL`` pairs (``baseline=...``, ``candidate=...`` or ``ROUTE=...``) into a dict."""
    urls: dict[str, str] = {}
    for spec in specs:
        key, sep, url = spec.partition("=")
        key, url = key.strip(), url.strip()
        if not sep or not key or not url.startswith(("http://", "https://")):
            raise ValueError(f"--dflash-engine-url {spec!r} must look like KEY=http://HOST:PORT "
                             "with KEY baseline, candidate or a route name")
        if key in urls:
            raise ValueError(f"--dflash-engine-url names {key!r} twice")
        urls[key] = url.rstrip("/")
    return urls


def url_key(selection: Mapping[str, str], registry: RouteRegistry, urls: Mapping[str, str]) -> str:
    """Which ``--dflash-engine-url`` serves ``selection``: ``baseline`` for the baselines, the
    route's own name, else ``candidate`` when exactly one route is switched on."""
    enabled = enabled_routes(selection, registry)
    if not enabled:
        key = "baseline"
    elif len(enabled) == 1 and enabled[0] in urls:
        key = enabled[0]
    elif len(enabled) == 1:
        key = "candidate"
    else:
        key = "+".join(enabled)
    if key not in urls:
        raise EngineUnsupported(
            f"no --dflash-engine-url serves the selection with {', '.join(enabled) or 'only'} "
            f"{'switched on' if enabled else 'baselines'}: pass --dflash-engine-url {key}=URL "
            f"(given: {', '.join(sorted(urls)) or 'none'})")
    return key


# ------------------------------------------------------------------------- what a server offers

# Sampling settings some servers apply on top of temperature/top_p by default (llama_cpp.server:
# repeat_penalty 1.1, min_p 0.05): set to their neutral value wherever the server declares them,
# so a completion is decoded exactly as the policy predeclares (greedy is greedy).
NEUTRAL_SAMPLING: dict[str, float] = {"repeat_penalty": 1.0, "presence_penalty": 0.0,
                                      "frequency_penalty": 0.0, "min_p": 0.0}
FORCE_BIAS = 1000.0  # logit bias that makes greedy decoding pick one given token


@dataclass(frozen=True)
class ServerAPI:
    """The endpoints and request fields a server offers, read from its OpenAPI document
    (``GET /openapi.json``: vLLM, llama_cpp.server and ``pytest-dflash serve`` publish one).
    A server without one (no OpenAPI document there) is taken to offer vLLM's API, which is
    what it is then asked for.

    - ``tokenize``: ``/tokenize`` (vLLM: ``prompt`` and ``add_special_tokens``) or
      ``/extras/tokenize`` (llama_cpp.server: ``input``; the model's BOS always added), else None;
    - ``token_prompts``: ``/v1/completions`` takes token-id prompts; without them, ids are
      detokenized and sent as text that must tokenize back to the same ids;
    - ``echo_logprobs``: ``echo`` and ``logprobs`` (prompt log-probs);
    - ``reset_prefix_cache``: ``POST /reset_prefix_cache``, which makes the next prefill cold;
    - ``fields``: the completion request's fields (neutral sampling, ``logit_bias``).
    """

    tokenize: str | None = "/tokenize"
    detokenize: str | None = "/detokenize"
    token_prompts: bool = True
    echo_logprobs: bool = True
    stream: bool = True
    reset_prefix_cache: bool = True
    fields: frozenset[str] = frozenset()
    source: str = "assumed vLLM's API (no /openapi.json)"

    @classmethod
    def from_openapi(cls, doc: Mapping[str, Any]) -> ServerAPI:
        paths = doc.get("paths") or {}
        body = _request_schema(doc, (paths.get("/v1/completions") or {}).get("post") or {})
        props = body.get("properties") or {}
        tokenize = next((p for p in ("/tokenize", "/extras/tokenize") if p in paths), None)
        detokenize = next((p for p in ("/detokenize", "/extras/detokenize") if p in paths), None)
        token_prompts = "prompt" in props and "integer" in _types(doc, props["prompt"])
        return cls(tokenize=tokenize, detokenize=detokenize, token_prompts=token_prompts,
                   echo_logprobs="echo" in props and "logprobs" in props,
                   stream="stream" in props, reset_prefix_cache="/reset_prefix_cache" in paths,
                   fields=frozenset(props), source="/openapi.json")

    def capabilities(self) -> Capabilities:
        """The server capabilities, less what this server's API cannot do (with the reason)."""
        reasons = dict(SERVER_CAPABILITIES.reasons)
        if not self.reset_prefix_cache:
            reasons["prefill_timing"] = ("the server has no POST /reset_prefix_cache, so a "
                                         "prefill may reuse the prompt it cached before and its "
                                         "time to first token is not a cold prefill's")
        elif not self.stream:
            reasons["prefill_timing"] = "the server's completions cannot be streamed"
        if self.tokenize is None:
            reasons["prompt_logprobs"] = ("the server offers no tokenize endpoint (/tokenize or "
                                          "/extras/tokenize), so segments cannot be scored "
                                          "token by token")
        elif not self.echo_logprobs:
            reasons["prompt_logprobs"] = ("the server's /v1/completions takes no echo with "
                                          "logprobs, so it returns no prompt log-probs")
        elif not self.token_prompts and self.detokenize is None:
            reasons["prompt_logprobs"] = ("the server takes text prompts only and offers no "
                                          "detokenize endpoint to turn token ids into text")
        return Capabilities(
            prefill_timing="prefill_timing" not in reasons, first_token_hash=False,
            verify_logits=False, route_hits=False, position_logits=False,
            prompt_logprobs="prompt_logprobs" not in reasons, reasons=reasons)

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "tokenize": self.tokenize,
                "detokenize": self.detokenize, "token_prompts": self.token_prompts,
                "echo_logprobs": self.echo_logprobs, "stream": self.stream,
                "reset_prefix_cache": self.reset_prefix_cache}


def _resolve(doc: Mapping[str, Any], schema: Any) -> Any:
    while isinstance(schema, Mapping) and "$ref" in schema:
        node: Any = doc
        for part in str(schema["$ref"]).lstrip("#/").split("/"):
            node = node.get(part, {}) if isinstance(node, Mapping) else {}
        schema = node
    return schema


def _request_schema(doc: Mapping[str, Any], operation: Mapping[str, Any]) -> dict[str, Any]:
    content = ((operation.get("requestBody") or {}).get("content") or {})
    schema = _resolve(doc, (content.get("application/json") or {}).get("schema") or {})
    return schema if isinstance(schema, dict) else {}


def _types(doc: Mapping[str, Any], schema: Any, depth: int = 0) -> set[str]:
    """Every JSON type named anywhere in ``schema`` (through refs, unions and array items)."""
    schema = _resolve(doc, schema)
    if depth > 8 or not isinstance(schema, Mapping):
        return set()
    found = {schema["type"]} if isinstance(schema.get("type"), str) else set()
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            found |= _types(doc, sub, depth + 1)
    if "items" in schema:
        found |= _types(doc, schema["items"], depth + 1)
    return found


# ------------------------------------------------------------------------- processes

def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, read from ``/proc``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


class ServerProcess:
    """One server started from a command template, in its own process group.

    ``command`` contains ``{port}``; it is split like a shell line (no shell runs it: the
    server is this process's own child) and started in a new session, so stopping the group
    stops every process the server spawned (vLLM starts engine workers).
    """

    def __init__(self, command: str, env: Mapping[str, str], label: str, *,
                 startup_timeout_s: float, log_dir: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        if "{port}" not in command:
            raise ValueError(f"--dflash-serve {command!r} must contain {{port}} where the "
                             "server's port goes, e.g. 'vllm serve MODEL --port {port}'")
        self.template, self.label, self.host = command, label, host
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port(host)
        self.command = command.replace("{port}", str(self.port))
        self.url = f"http://{host}:{self.port}"
        log_dir = Path(log_dir or tempfile.gettempdir())
        log_dir.mkdir(parents=True, exist_ok=True)
        self._log = tempfile.NamedTemporaryFile(prefix="dflash-server-", suffix=".log",
                                                dir=log_dir, delete=False)
        self.log_path = Path(self._log.name)
        argv = shlex.split(self.command)
        self.proc = subprocess.Popen(argv, env=dict(env),
                                     stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return text[-chars:].strip() or "(empty log)"

    def describe(self, problem: str) -> ServerError:
        status = self.proc.poll()
        state = "still running" if status is None else f"exit status {status}"
        return ServerError(f"server for {self.label} {problem}: command {self.command!r}, "
                           f"{state}; log {self.log_path}, tail:\n{self.log_tail()}")

    def wait_healthy(self) -> None:
        """Poll ``/health`` (then ``/v1/models``) until it answers 200, the process exits or
        the startup timeout passes; the latter two are :class:`ServerError`. A server without
        ``/health`` (404: llama_cpp.server has none) is healthy once ``/v1/models`` lists its
        model (it loads the model before it listens)."""
        httpx = _httpx()
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise self.describe("exited before it became healthy")
                try:
                    if client.get("/health").status_code in (200, 404) \
                            and client.get("/v1/models").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise self.describe(f"did not become healthy within "
                                        f"{self.startup_timeout_s:g} s")
                time.sleep(0.2)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM to the whole process group, SIGKILL after ``grace_s``, then wait until no
        process of the group is left; the server's exit status."""
        try:
            if self.proc.poll() is None:
                self._signal(signal.SIGTERM)
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self._signal(signal.SIGKILL)
                    self.proc.wait(grace_s)
            if not self._group_ends(grace_s):  # workers the server left behind
                self._signal(signal.SIGKILL)
                self._group_ends(grace_s)
            left = group_members(self.pid)
            if left:
                raise self.describe(f"left processes {left} of its group running after SIGKILL")
        finally:
            self._log.close()
        return self.proc.returncode

    def _group_ends(self, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        while group_members(self.pid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class ServerPool:
    """The servers of one session: at most one started server alive at a time.

    With a command, each selection gets its own server, started on first use with that
    selection's switches; using another selection stops it first (two full-size servers never
    share a GPU). With URLs, selections map to the user's servers and nothing is started.
    """

    def __init__(self, registry: RouteRegistry, *, command: str | None = None,
                 urls: Mapping[str, str] | None = None, profile: str | None = None,
                 device: str | None = None, startup_timeout_s: float = 600.0,
                 request_timeout_s: float = 600.0, stop_limit: int = STOP_LIMIT,
                 log_dir: Path | None = None, base_env: Mapping[str, str] | None = None) -> None:
        if (command is None) == (not urls):
            raise ValueError("give either a --dflash-serve command or --dflash-engine-url "
                             "URLs, not both and not neither")
        if command is not None and "{port}" not in command:
            raise ValueError(f"--dflash-serve {command!r} must contain {{port}} where the "
                             "server's port goes, e.g. 'vllm serve MODEL --port {port}'")
        self.registry, self.command, self.urls = registry, command, dict(urls or {})
        self.profile, self.device = profile, device
        self.startup_timeout_s, self.request_timeout_s = startup_timeout_s, request_timeout_s
        self.stop_limit, self.log_dir = stop_limit, log_dir
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.current: tuple[tuple[str, str], ...] | None = None
        self.process: ServerProcess | None = None
        self.engines: dict[tuple[tuple[str, str], ...], ServerEngine] = {}
        self.history: list[dict[str, Any]] = []  # every server started: the route proof
        self.failed: dict[tuple[tuple[str, str], ...], ServerError] = {}
        # what the servers offer, probed once per URL given or once for the command: a route's
        # settings change how a server computes, not which endpoints it has
        self.apis: dict[str, ServerAPI] = {}
        self.closed = False

    def engine(self, selection: Mapping[str, str]) -> ServerEngine:
        key = selection_key(selection)
        if key not in self.engines:
            if self.urls:
                url_key(selection, self.registry, self.urls)  # unknown selection: said now
            self.engines[key] = ServerEngine(self, dict(selection),
                                             stop_limit=self.stop_limit,
                                             request_timeout_s=self.request_timeout_s)
        return self.engines[key]

    def label(self, selection: Mapping[str, str]) -> str:
        enabled = enabled_routes(selection, self.registry)
        return " + ".join(enabled) if enabled else "the baselines"

    def proof(self, selection: Mapping[str, str]) -> dict[str, Any]:
        return {"switches": switches_for(selection, self.registry),
                "enabled_routes": enabled_routes(selection, self.registry)}

    def url_for(self, selection: Mapping[str, str]) -> str:
        """The base URL serving ``selection``, starting its server (and stopping another) if
        this pool starts servers."""
        if self.closed:
            raise ServerError("the server pool is closed (the session ended)")
        if self.urls:
            return self.urls[url_key(selection, self.registry, self.urls)]
        key = selection_key(selection)
        if key in self.failed:  # a server that failed once is not started again
            raise self.failed[key]
        if self.current == key and self.process is not None:
            if self.process.proc.poll() is not None:
                raise self.process.describe("exited while serving")
            return self.process.url
        self.stop()
        if self.command is None:
            raise ServerError(f"no server for {self.label(selection)}: give its URL with "
                              "--dflash-engine-url or a command with --dflash-serve")
        env = server_env(selection, self.registry, self.base_env, self.profile, self.device)
        process = ServerProcess(self.command, env, self.label(selection),
                                startup_timeout_s=self.startup_timeout_s,
                                log_dir=self.log_dir)
        self.process, self.current = process, key
        self.history.append({"selection": dict(selection), **self.proof(selection),
                             "command": process.command, "pid": process.pid,
                             "log": str(process.log_path)})
        try:
            process.wait_healthy()
        except ServerError as exc:
            self.failed[key] = exc
            self.stop()
            raise
        return process.url

    def describe(self, selection: Mapping[str, str], problem: str) -> ServerError:
        key = selection_key(selection)
        if self.process is not None and self.current == key:
            return self.process.describe(problem)
        where = self.urls.get(url_key(selection, self.registry, self.urls), "?") \
            if self.urls else "?"
        return ServerError(f"server for {self.label(selection)} at {where} {problem}")

    def stop(self) -> None:
        if self.process is not None:
            timeout_s = min(COUNTERS_TIMEOUT_S, self.request_timeout_s)
            counters = self._counters(self.process, timeout_s)
            status = self.process.stop()
            for entry in self.history:
                if entry["pid"] == self.process.pid:
                    entry["exit_status"] = status
                    entry["counters"] = counters
            self.process, self.current = None, None

    @staticmethod
    def _counters(process: ServerProcess, timeout_s: float) -> dict[str, int]:
        """The server's own route counters just before it stops (``GET /dflash/route_hits``,
        where it has them), so the route proof survives the server. Asked within the pool's
        request timeout (at most ``COUNTERS_TIMEOUT_S``): a server that hangs on a request is
        stopped without waiting longer than any other request would."""
        if process.proc.poll() is not None:
            return {}
        httpx = _httpx()
        try:
            response = httpx.get(f"{process.url}/dflash/route_hits", timeout=timeout_s)
            if response.status_code == 200:
                return {str(k): int(v) for k, v in response.json().items()}
        except Exception:  # any failure here (a refused or half-dead server) means no counters:
            pass  # stopping the server, and the session, must go on
        return {}

    def last_counters(self, selection: Mapping[str, str]) -> dict[str, int]:
        """Counters of the last stopped server of ``selection`` (empty if none reported)."""
        for entry in reversed(self.history):
            if entry["selection"] == dict(selection) and "counters" in entry:
                return dict(entry["counters"])
        return {}

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.stop()
        self.closed = True


# ------------------------------------------------------------------------- the engine

class ServerEngine:
    """The engine protocol over one route selection's server (see the module docstring)."""

    def __init__(self, pool: ServerPool, selection: dict[str, str], *,
                 stop_limit: int = STOP_LIMIT, request_timeout_s: float = 600.0) -> None:
        if stop_limit < 0:
            raise ValueError(f"stop_limit must be >= 0, got {stop_limit}")
        self.pool, self.selection = pool, selection
        self.stop_limit, self.request_timeout_s = stop_limit, request_timeout_s
        self._client: Any = None
        self._url: str | None = None
        self.model: str | None = None
        self.server_info: dict[str, Any] = {}
        self._bos: list[int] | None = None

    @property
    def capabilities(self) -> Capabilities:
        """What this server offers, probed from its API (see :class:`ServerAPI`)."""
        return self.api.capabilities()

    @property
    def api(self) -> ServerAPI:
        """The server's API, probed on first use (this may start the selection's server)."""
        key = self.pool.command or self.pool.url_for(self.selection)
        if key not in self.pool.apis:
            self._connect()
            self.pool.apis[key] = self._probe()
        return self.pool.apis[key]

    def _probe(self) -> ServerAPI:
        httpx = _httpx()
        try:
            response = self._client.get("/openapi.json")
        except httpx.HTTPError as exc:
            raise self.pool.describe(self.selection, f"failed GET /openapi.json: {exc}") from None
        try:
            doc = response.json() if response.status_code == 200 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or "openapi" not in doc or "paths" not in doc:
            return ServerAPI(source=f"assumed vLLM's API (GET /openapi.json: HTTP "
                                    f"{response.status_code}, no OpenAPI document)")
        return ServerAPI.from_openapi(doc)

    def _require(self, capability: str) -> ServerAPI:
        api = self.api
        caps = api.capabilities()
        if not caps.offers(capability):
            raise EngineUnsupported(f"server for {self.pool.label(self.selection)}: "
                                    f"{caps.reasons[capability]}")
        return api

    # ----------------------------------------------------------------- transport
    def _connect(self) -> Any:
        httpx = _httpx()
        url = self.pool.url_for(self.selection)
        if self._client is None or url != self._url:
            if self._client is not None:
                self._client.close()
            self._client = httpx.Client(base_url=url, timeout=self.request_timeout_s)
            self._url = url
            self.model = None
        if self.model is None:
            models = self._json("GET", "/v1/models")
            data = models.get("data") or []
            if not data or "id" not in data[0]:
                raise self.pool.describe(self.selection, f"lists no model at /v1/models "
                                                         f"({models!r:.200})")
            self.model = data[0]["id"]
            self.server_info = {k: v for k, v in data[0].items() if k != "id"}
            self._check_routes(data[0])
        return self._client

    def _check_routes(self, model: Mapping[str, Any]) -> None:
        """A server that reports its routes (``pytest-dflash serve`` does) must run exactly the
        selection's: switches it did not honour are a silent fallback, refused here."""
        served = (model.get("dflash") or {}).get("selection")
        if served is None:
            return
        wanted = {**self.pool.registry.engine_selection(), **self.selection}
        wrong = {family: route for family, route in served.items()
                 if wanted.get(family, route) != route}
        unserved = [name for name in enabled_routes(self.selection, self.pool.registry)
                    if name not in served.values()]
        if wrong or unserved:
            raise self.pool.describe(
                self.selection, f"runs routes {served}, not the selection {wanted} its "
                                "switches asked for")

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        httpx = _httpx()
        client = self._client if path == "/v1/models" else self._connect()
        try:
            response = client.request(method, path, json=body)
        except httpx.TimeoutException:
            raise self.pool.describe(self.selection, f"did not answer {method} {path} within "
                                                     f"{self.request_timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise self.pool.describe(self.selection, f"failed {method} {path}: {exc}") from None
        if response.status_code == 404:
            raise EngineUnsupported(f"server for {self.pool.label(self.selection)} has no "
                                    f"{method} {path} (HTTP 404)")
        if response.status_code >= 400:
            error = self.pool.describe(self.selection, f"answered {method} {path} with HTTP "
                                                       f"{response.status_code}: "
                                                       f"{response.text[:500]}")
            if response.status_code < 500:  # the request was refused as invalid: our request,
                origin.mark(error, origin.HARNESS)  # not the served candidate, is at fault
            raise error
        try:
            return response.json()
        except ValueError:
            raise self.pool.describe(self.selection, f"answered {method} {path} with non-JSON "
                                                     f"{response.text[:200]!r}") from None

    def _choice(self, body: dict[str, Any]) -> dict[str, Any]:
        reply = self._json("POST", "/v1/completions", {"model": self.model, **body})
        choices = reply.get("choices") or []
        if len(choices) != 1:
            raise self.pool.describe(self.selection, f"returned {len(choices)} choices for one "
                                                     "prompt")
        return choices[0]

    # ----------------------------------------------------------------- protocol
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``/tokenize`` (vLLM), or ``/extras/tokenize`` (llama_cpp.server), which always adds
        the model's BOS: it is then taken off when ``add_special_tokens`` is false (the BOS is
        what the server puts in front of an empty text)."""
        api = self.api
        if api.tokenize is None:
            raise EngineUnsupported(f"server for {self.pool.label(self.selection)}: "
                                    f"{api.capabilities().reasons['prompt_logprobs']}")
        if api.tokenize == "/tokenize":
            return self._tokens({"prompt": text, "add_special_tokens": add_special_tokens})
        tokens = self._tokens({"input": text})
        bos = self.bos_prefix()
        if not add_special_tokens and bos and tokens[: len(bos)] == bos:
            tokens = tokens[len(bos):]
        return tokens

    def bos_prefix(self) -> list[int]:
        """The token ids the server puts in front of every prompt (its BOS, or nothing)."""
        if self._bos is None:
            api = self.api
            self._bos = (self._tokens({"prompt": "", "add_special_tokens": True})
                         if api.tokenize == "/tokenize" else self._tokens({"input": ""}))
        return list(self._bos)

    def _tokens(self, body: dict[str, Any]) -> list[int]:
        path = self.api.tokenize or "/tokenize"
        reply = self._json("POST", path, {"model": self.model, **body})
        tokens = reply.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise self.pool.describe(self.selection, f"{path} returned no token ids "
                                                     f"({reply!r:.200})")
        return tokens

    def _prompt(self, ids: list[int]) -> list[int] | str:
        """``ids`` as the server takes a prompt: the ids themselves, or (a server that takes
        text only) their text, which the server tokenizes with its BOS: checked to give back
        exactly ``ids``, since scoring other tokens than asked would be a silent change."""
        api = self.api
        if api.token_prompts:
            return ids
        bos = self.bos_prefix()
        if not bos or ids[: len(bos)] != bos:
            raise EngineUnsupported(
                f"server for {self.pool.label(self.selection)} takes text prompts only and "
                f"puts {bos or 'no BOS'} in front of every prompt; ids that do not start with "
                "it cannot be sent")
        reply = self._json("POST", api.detokenize or "/detokenize",
                           {"model": self.model, "tokens": ids[len(bos):]})
        text = reply.get("text", reply.get("prompt"))
        if not isinstance(text, str):
            raise self.pool.describe(self.selection, f"{api.detokenize} returned no text "
                                                     f"({reply!r:.200})")
        if self.encode(text, add_special_tokens=True) != ids:
            raise EngineUnsupported(
                f"server for {self.pool.label(self.selection)} takes text prompts only, and the "
                f"text of these {len(ids)} token ids does not tokenize back to them; score ids "
                "that come from the server's own encode()")
        return text

    def score(self, token_ids: list[int]) -> list[float]:
        """The echoed prompt log-probs of a one-token completion. vLLM echoes one entry per
        prompt token, the first null. llama_cpp.server drops the BOS from the echo and nulls
        the entry after it, though that token's log-prob exists: it is then asked for as the
        streamed one-token completion of the BOS alone, forced by ``logit_bias`` (the reported
        log-prob is the model's, before the bias). Which of the two the server did is read from the
        count of echoed entries, never assumed from its name."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError("score needs at least two token ids (e.g. BOS and one token)")
        self._require("prompt_logprobs")
        reply = self._json("POST", "/v1/completions", {
            "model": self.model, "prompt": self._prompt(ids), "max_tokens": 1,
            "temperature": 0.0, "echo": True, "logprobs": 1})
        choices = reply.get("choices") or []
        logprobs = ((choices[0] if len(choices) == 1 else {}).get("logprobs") or {}) \
            .get("token_logprobs")
        generated = (reply.get("usage") or {}).get("completion_tokens")
        if not isinstance(logprobs, list) or not isinstance(generated, int):
            raise self.pool.describe(self.selection, f"did not echo prompt log-probs and usage "
                                                     f"for {len(ids)} ids ({reply!r:.300})")
        echoed = len(logprobs) - generated
        if echoed == len(ids):
            scores = logprobs[1 : len(ids)]
        elif echoed == len(ids) - 1 and ids[: len(self.bos_prefix())] == self.bos_prefix() \
                and len(self.bos_prefix()) == 1:
            scores = [self._forced_first(ids[1]), *logprobs[1 : len(ids) - 1]]
        else:
            raise self.pool.describe(
                self.selection, f"echoed {echoed} prompt log-probs for {len(ids)} prompt ids "
                                f"(and {generated} generated); expected {len(ids)}, or "
                                f"{len(ids) - 1} without the BOS")
        if any(not isinstance(v, (int, float)) for v in scores):
            raise self.pool.describe(self.selection, "echoed a null log-prob inside the prompt")
        return [float(v) for v in scores]

    def _forced_first(self, token: int) -> float:
        """log p(token | BOS): the streamed one-token completion of the BOS alone, with
        ``token`` forced by a logit bias; the server must report the token it was forced to.
        llama_cpp.server reports a non-streamed completion of an empty prompt without
        log-probs; streamed, its first event has the model's log-prob (before the bias), and
        its generator then fails (0.3.36: an index past its scores), so the stream is closed
        as soon as the token's event arrives: nothing after it is needed."""
        httpx = _httpx()
        if "logit_bias" not in self.api.fields or not self.api.stream:
            raise EngineUnsupported(
                f"server for {self.pool.label(self.selection)} leaves the first token's "
                "log-prob out of its echo and takes no logit_bias with stream to ask for it")
        reply = self._json("POST", self.api.detokenize or "/detokenize",
                           {"model": self.model, "tokens": [token]})
        want = reply.get("text", reply.get("prompt"))
        body = {"model": self.model, "prompt": "", "max_tokens": 1, "temperature": 0.0,
                "logprobs": 1, "stream": True, "logit_bias": {str(token): FORCE_BIAS},
                **self._neutral()}
        values: list[Any] = []
        pieces: list[Any] = []
        try:
            with self._connect().stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self.pool.describe(self.selection, f"answered a forced completion "
                                                             f"with HTTP {response.status_code}: "
                                                             f"{response.text[:300]}")
                for line in response.iter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        choice = (json.loads(line[5:]).get("choices") or [{}])[0]
                        logprobs = choice.get("logprobs") or {}
                        values += logprobs.get("token_logprobs") or []
                        pieces += logprobs.get("tokens") or []
                        if values:  # the one token asked for; the stream is closed here
                            break
        except httpx.HTTPError as exc:
            raise self.pool.describe(self.selection, f"failed a forced completion: "
                                                     f"{exc}") from None
        if len(values) != 1 or not isinstance(values[0], (int, float)) or pieces != [want]:
            raise self.pool.describe(self.selection, f"did not complete the BOS with the forced "
                                                     f"token {token} ({want!r}): log-probs "
                                                     f"{values!r:.200} of tokens {pieces!r:.200}")
        return float(values[0])

    def _neutral(self) -> dict[str, float]:
        return {k: v for k, v in NEUTRAL_SAMPLING.items() if k in self.api.fields}

    def generate_many(self, prompts: list[str], max_new_tokens: int,
                      stop: list[str] | None = None, sampling: Sampling | None = None,
                      batch: int = 32,
                      on_complete: Callable[[int, Generation], None] | None = None,
                      ) -> list[Generation]:
        """:meth:`generate` for every prompt, with up to ``batch`` requests in flight at once,
        as lm-evaluation-harness's ``num_concurrent`` does: a serving engine batches concurrent
        requests itself (vLLM's continuous batching), ``pytest-dflash serve`` answers them in
        turn. Each completion is what :meth:`generate` returns for its prompt, in prompt order;
        ``on_complete(index, generation)`` runs in the thread that received it."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"generate_many needs batch >= 1 requests in flight, got {batch!r}")
        if not prompts:
            return []
        self._connect()  # the server is up and checked before the threads share its client

        def one(index: int) -> Generation:
            gen = self.generate(prompts[index], max_new_tokens, stop, sampling)
            if on_complete is not None:
                on_complete(index, gen)
            return gen

        with ThreadPoolExecutor(max_workers=min(batch, len(prompts))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def generate(self, prompt: str, max_new_tokens: int, stop: list[str] | None = None,
                 sampling: Sampling | None = None) -> Generation:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        sampling = sampling or Sampling()
        stops = [s for s in (stop or []) if s]
        self._connect()
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p,
                                "seed": sampling.seed, "return_token_ids": True,
                                **self._neutral(), **sampling.extra}
        if stops[: self.stop_limit]:
            body["stop"] = stops[: self.stop_limit]
        choice = self._choice(body)
        text, reason = choice.get("text"), choice.get("finish_reason")
        if not isinstance(text, str):
            raise self.pool.describe(self.selection, f"returned no completion text "
                                                     f"({choice!r:.200})")
        if reason not in ("stop", "length"):
            raise self.pool.describe(self.selection, f"ended a completion with finish_reason "
                                                     f"{reason!r} (expected stop or length)")
        text, cut = apply_stops(text, stops)
        token_ids = choice.get("token_ids")
        if isinstance(token_ids, list) and token_ids and reason == "stop" \
                and "stop_reason" in choice and not isinstance(choice["stop_reason"], str):
            token_ids = token_ids[:-1]  # vLLM returns the EOS / stop token; the protocol does not
        if cut or not isinstance(token_ids, list):
            # a cut the server did not make, or a server that does not return ids
            token_ids = self.encode(text) if text else []
        return Generation(text, [int(t) for t in token_ids], "stop" if cut else reason)

    def prefill(self, token_ids: list[int]) -> PrefillResult:
        """A streamed one-token completion; seconds = time to the first token."""
        httpx = _httpx()
        ids = [int(t) for t in token_ids]
        prompt = self._prompt(ids)
        client = self._connect()
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                "stream": True, "return_token_ids": True, **self._neutral()}
        first: dict[str, Any] | None = None
        t0 = time.perf_counter()
        try:
            with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise self.pool.describe(self.selection, f"answered a streamed completion "
                                                             f"with HTTP {response.status_code}:"
                                                             f" {response.text[:300]}")
                for line in response.iter_lines():
                    if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                        if first is None:
                            seconds = time.perf_counter() - t0
                            first = json.loads(line[5:])
        except httpx.HTTPError as exc:
            raise self.pool.describe(self.selection, f"failed a streamed completion: "
                                                     f"{exc}") from None
        if first is None:
            raise self.pool.describe(self.selection, "streamed no token for a prefill")
        choice = (first.get("choices") or [{}])[0]
        ids_out = choice.get("token_ids") or []
        token = int(ids_out[0]) if ids_out else -1
        return PrefillResult(token, "", len(ids), seconds, None)

    def verify(self, draft_ids: list[int]) -> Any:
        raise EngineUnsupported(SERVER_CAPABILITIES.reasons["verify_logits"])

    def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` (vLLM offers it in its development mode)."""
        httpx = _httpx()
        self._require("prefill_timing")
        client = self._connect()
        try:
            response = client.post("/reset_prefix_cache")
        except httpx.HTTPError as exc:
            raise self.pool.describe(self.selection, f"failed POST /reset_prefix_cache: "
                                                     f"{exc}") from None
        if response.status_code >= 400:
            raise EngineUnsupported(f"server for {self.pool.label(self.selection)} cannot reset "
                                    f"its prefix cache (POST /reset_prefix_cache: HTTP "
                                    f"{response.status_code}); a cold prefill cannot be timed")

    def route_hits(self) -> dict[str, int]:
        """The server's own route counters (``GET /dflash/route_hits``), empty if it has none."""
        try:
            return {str(k): int(v) for k, v in self._json("GET", "/dflash/route_hits").items()}
        except EngineUnsupported:
            return {}

    def route_proof(self) -> dict[str, Any]:
        """The switches this selection's server was started with, plus its own counters: read
        live from a server that is running, else as it reported them when it was stopped (a
        proof never starts a server again)."""
        live = self.pool.current == selection_key(self.selection) or bool(self.pool.urls)
        counters = self.route_hits() if live else self.pool.last_counters(self.selection)
        api = self.pool.apis.get(self.pool.command or self._url or "")
        return {**self.pool.proof(self.selection), "counters": counters,
                "model": self.model, "server": self.server_info,
                "api": api.as_dict() if api is not None else None}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __repr__(self) -> str:
        return f"<ServerEngine {self.pool.label(self.selection)} model={self.model}>"
