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
from pathlib import Path
from typing import Any

from pytest_dflash.engines import (
    Capabilities,
    EngineUnsupported,
    Generation,
    PrefillResult,
    Sampling,
)
from pytest_dflash.xdist import gpus

STOP_LIMIT = 4  # the OpenAI completions API takes at most four stop sequences
SELECTION_ENV = "DFLASH_ROUTES"  # names of the enabled routes, so a server can check its switches
PROFILE_ENV = "DFLASH_PROFILE"
DEVICE_ENV = "DFLASH_DEVICE"
LOG_TAIL_CHARS = 3000

SERVER_CAPABILITIES = Capabilities(
    prefill_timing=True,
    first_token_hash=False,
    verify_logits=False,
    route_hits=False,
    reasons={
        "first_token_hash": "an OpenAI-compatible server returns top-k log-probs, not the full "
                            "logits a bitwise first-token hash needs",
        "verify_logits": "an OpenAI-compatible server has no verify step of M <= 8 draft rows "
                         "on a cached prefix",
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

def switches_for(selection: Mapping[str, str], registry: Any) -> dict[str, str]:
    """``NAME=1`` for every non-baseline route in ``selection`` (what ``pytest-dflash enable``
    prints for accepted routes), the switches of every other registered candidate absent."""
    env = {}
    for name in sorted(selection.values()):
        route = registry.get(name)
        if route.role == "candidate":
            env[route.enable_switch] = "1"
    return env


def enabled_routes(selection: Mapping[str, str], registry: Any) -> list[str]:
    return sorted(n for n in selection.values() if registry.get(n).role == "candidate")


def server_env(selection: Mapping[str, str], registry: Any, base: Mapping[str, str],
               profile: str | None = None, device: str | None = None) -> dict[str, str]:
    """The environment of a server for ``selection``: ``base`` without any registered route's
    switch (none leaks in from the caller's shell), then this selection's switches. Started by
    an xdist worker that owns a GPU, the server sees that GPU only (docs/multi-gpu.md)."""
    env = gpus.server_env(base)
    for route in registry:
        env.pop(route.enable_switch, None)
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


def url_key(selection: Mapping[str, str], registry: Any, urls: Mapping[str, str]) -> str:
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
        the startup timeout passes; the latter two are :class:`ServerError`."""
        httpx = _httpx()
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.url, timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise self.describe("exited before it became healthy")
                try:
                    if client.get("/health").status_code == 200 \
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

    def __init__(self, registry: Any, *, command: str | None = None,
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
        self.closed = False

    def engine(self, selection: Mapping[str, str]) -> ServerEngine:
        key = tuple(sorted(selection.items()))
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
        key = tuple(sorted(selection.items()))
        if key in self.failed:  # a server that failed once is not started again
            raise self.failed[key]
        if self.current == key and self.process is not None:
            if self.process.proc.poll() is not None:
                raise self.process.describe("exited while serving")
            return self.process.url
        self.stop()
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
        key = tuple(sorted(selection.items()))
        if self.process is not None and self.current == key:
            return self.process.describe(problem)
        where = self.urls.get(url_key(selection, self.registry, self.urls), "?") \
            if self.urls else "?"
        return ServerError(f"server for {self.label(selection)} at {where} {problem}")

    def stop(self) -> None:
        if self.process is not None:
            counters = self._counters(self.process)
            status = self.process.stop()
            for entry in self.history:
                if entry["pid"] == self.process.pid:
                    entry["exit_status"] = status
                    entry["counters"] = counters
            self.process, self.current = None, None

    @staticmethod
    def _counters(process: ServerProcess) -> dict[str, int]:
        """The server's own route counters just before it stops (``GET /dflash/route_hits``,
        where it has them), so the route proof survives the server."""
        if process.proc.poll() is not None:
            return {}
        httpx = _httpx()
        try:
            response = httpx.get(f"{process.url}/dflash/route_hits", timeout=10.0)
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

    capabilities = SERVER_CAPABILITIES

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
            raise self.pool.describe(self.selection, f"answered {method} {path} with HTTP "
                                                     f"{response.status_code}: "
                                                     f"{response.text[:500]}")
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
        self._connect()
        reply = self._json("POST", "/tokenize", {"model": self.model, "prompt": text,
                                                 "add_special_tokens": add_special_tokens})
        tokens = reply.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise self.pool.describe(self.selection, f"/tokenize returned no token ids "
                                                     f"({reply!r:.200})")
        return tokens

    def score(self, token_ids: list[int]) -> list[float]:
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError("score needs at least two token ids (e.g. BOS and one token)")
        self._connect()
        choice = self._choice({"prompt": ids, "max_tokens": 1, "temperature": 0.0,
                               "echo": True, "logprobs": 1})
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list) or len(logprobs) < len(ids):
            raise self.pool.describe(
                self.selection, f"did not echo {len(ids)} prompt log-probs (got "
                                f"{None if logprobs is None else len(logprobs)}); the server "
                                "must support echo with logprobs on token-id prompts")
        scores = logprobs[1 : len(ids)]
        if any(not isinstance(v, (int, float)) for v in scores):
            raise self.pool.describe(self.selection, "echoed a null log-prob inside the prompt")
        return [float(v) for v in scores]

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
                                **sampling.extra}
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
        client = self._connect()
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "stream": True, "return_token_ids": True}
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
        live = self.pool.current == tuple(sorted(self.selection.items())) or bool(self.pool.urls)
        counters = self.route_hits() if live else self.pool.last_counters(self.selection)
        return {**self.pool.proof(self.selection), "counters": counters,
                "model": self.model, "server": self.server_info}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __repr__(self) -> str:
        return f"<ServerEngine {self.pool.label(self.selection)} model={self.model}>"
