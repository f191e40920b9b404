"""The server engine against a real ``pytest-dflash serve`` process on a loopback port.

Every server here is a real subprocess started by :class:`ServerPool` from a ``{port}``
command, exactly as ``--dflash-serve`` starts one; what it answers is compared with the
in-process reference engine of the same selection and profile.
"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from pytest_dflash.engines import EngineUnsupported, Sampling, missing
from pytest_dflash.engines import reference as ref
from pytest_dflash.engines.openai_server import (
    ServerAPI,
    ServerError,
    ServerPool,
    apply_stops,
    group_members,
    server_env,
    switches_for,
)
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry
from pytest_dflash.routes.shipped import SHIPPED_ROUTES

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

SERVE = f"{sys.executable} -m pytest_dflash.cli serve --port {{port}} --profile quick"
FP16 = "prefill.geometry.fp16_q7920"
TEXT = 'def scale(xs, k):\n    """Multiply every item by k."""\n    return [x * k for x in xs]\n'


def shipped_registry() -> RouteRegistry:
    registry = RouteRegistry()
    for route in SHIPPED_ROUTES:
        registry.register(route)
    return registry


def gone(pid: int) -> bool:
    """No live process left in the server's process group (zombies reaped or not)."""
    return not group_members(pid)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    pool = ServerPool(shipped_registry(), command=SERVE, profile="quick",
                      startup_timeout_s=180, request_timeout_s=300,
                      log_dir=tmp_path_factory.mktemp("server-logs"))
    yield pool
    pool.close()
    assert all(gone(entry["pid"]) for entry in pool.history)


@pytest.fixture(scope="module")
def local():
    return ref.build({}, "quick")


def test_stop_strings_cut_where_a_decoder_would_stop():
    assert apply_stops("ab\ndef f", ["\ndef "]) == ("ab", True)
    assert apply_stops("no stop here", ["\ndef ", "\n#"]) == ("no stop here", False)
    # "c" completes before "abcd" does: a decoder checking after each character stops there
    assert apply_stops("abcd", ["abcd", "c"]) == ("ab", True)
    assert apply_stops("x\n#y\ndef z", ["\ndef ", "\n#"]) == ("x", True)


def test_server_environment_carries_exactly_the_selection_switches():
    registry = shipped_registry()
    leak = {"DFLASH_PREFILL_GEOMETRY_FP32_Q6592": "1", "KEEP": "me"}
    env = server_env(registry.engine_selection([FP16]), registry, leak, profile="quick")
    assert env["DFLASH_PREFILL_GEOMETRY_FP16_Q7920"] == "1"
    assert "DFLASH_PREFILL_GEOMETRY_FP32_Q6592" not in env, "a caller's switch leaked in"
    assert env["KEEP"] == "me" and env["DFLASH_ROUTES"] == FP16
    assert switches_for(registry.engine_selection(), registry) == {}


def test_route_server_env_reaches_the_server_and_nothing_leaks_in():
    """A route's ``server_env`` (a server's own settings) is in the environment exactly while
    the route is on; the caller's values of those variables never leak into another
    selection's server; two routes asking one setting for different values are refused."""
    registry = shipped_registry()
    registry.register(Route("prefill.geometry.ub64", "prefill.geometry", "candidate",
                            baseline="prefill.geometry.fp32_q3296", gates=("ppl",),
                            server_env={"N_UBATCH": "64"}))
    registry.register(Route("attn.d256.fa_env", "attn.d256", "candidate",
                            baseline="attn.d256.sdpa", gates=("ppl",),
                            server_env={"N_UBATCH": "128"}))
    leak = {"N_UBATCH": "999", "KEEP": "me"}
    on = server_env(registry.engine_selection(["prefill.geometry.ub64"]), registry, leak)
    assert on["N_UBATCH"] == "64" and on["DFLASH_PREFILL_GEOMETRY_UB64"] == "1"
    off = server_env(registry.engine_selection(), registry, leak)
    assert "N_UBATCH" not in off and off["KEEP"] == "me"
    with pytest.raises(ValueError, match="both set N_UBATCH"):
        switches_for(registry.engine_selection(["prefill.geometry.ub64", "attn.d256.fa_env"]),
                     registry)
    with pytest.raises(RegistryError, match="server_env"):
        Route("prefill.geometry.bad", "prefill.geometry", "candidate",
              baseline="prefill.geometry.fp32_q3296", gates=("ppl",), server_env={"X": 1})


def test_the_engine_reads_what_the_server_offers_from_its_openapi(pool):
    """``pytest-dflash serve`` publishes token-id prompts, echo, stream and a prefix-cache
    reset: every capability a server can have is found; a server without the reset endpoint
    loses prefill timing, with the reason."""
    server = pool.engine(pool.registry.engine_selection())
    api = server.api
    assert (api.source, api.tokenize, api.token_prompts, api.reset_prefix_cache) == \
        ("/openapi.json", "/tokenize", True, True)
    assert server.capabilities.prompt_logprobs and server.capabilities.prefill_timing
    doc = server._client.get("/openapi.json").json()
    del doc["paths"]["/reset_prefix_cache"]
    caps = ServerAPI.from_openapi(doc).capabilities()
    assert not caps.prefill_timing and "reset_prefix_cache" in caps.reasons["prefill_timing"]
    assert server.route_proof()["api"]["token_prompts"] is True


def test_encode_and_score_match_the_in_process_engine(pool, local):
    registry = pool.registry
    server = pool.engine(registry.engine_selection())
    assert server.encode(TEXT) == local.encode(TEXT)
    ids = server.encode(TEXT, add_special_tokens=True)
    assert ids == local.encode(TEXT, add_special_tokens=True) and ids[0] != ids[1]
    got, want = server.score(ids), local.score(ids)
    assert len(got) == len(want) == len(ids) - 1
    ppl_got = math.exp(-sum(got) / len(got))
    ppl_want = math.exp(-sum(want) / len(want))
    assert abs(ppl_got - ppl_want) <= 1e-6 * ppl_want
    assert server.route_proof()["switches"] == {}


def test_generate_matches_in_process_with_stops_beyond_the_api_limit(pool, local):
    from dflash_fixtures.tasks import STOP
    from pytest_dflash.engines.data import coding_tasks

    assert len(STOP) > 4, "this test needs more stop strings than the API takes"
    server = pool.engine(pool.registry.engine_selection())
    for task in coding_tasks("quick")[:1]:
        got = server.generate(task["prompt"], 64, STOP, Sampling())
        want = local.generate(task["prompt"], 64, STOP, Sampling())
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
        assert got.token_ids[: len(local.encode(got.text))] == local.encode(got.text)


def test_generate_many_sends_concurrent_requests_and_keeps_prompt_order(pool, local):
    import threading

    from dflash_fixtures.tasks import STOP
    from pytest_dflash.engines.data import coding_tasks

    server = pool.engine(pool.registry.engine_selection())
    prompts = [task["prompt"] for task in coding_tasks("quick")[:3]]
    finished: list[tuple[int, str]] = []
    got = server.generate_many(prompts, 32, STOP, Sampling(), batch=3,
                               on_complete=lambda i, g: finished.append(
                                   (i, threading.current_thread().name)))
    want = [local.generate(p, 32, STOP, Sampling()) for p in prompts]
    assert [(g.text, g.finish_reason) for g in got] == [(w.text, w.finish_reason) for w in want]
    assert sorted(i for i, _ in finished) == [0, 1, 2]
    assert all(name != threading.main_thread().name for _, name in finished), finished
    with pytest.raises(ValueError, match="batch >= 1"):
        server.generate_many(prompts, 8, batch=0)


def test_prefill_times_the_first_token_and_verify_is_declared_missing(pool, local):
    server = pool.engine(pool.registry.engine_selection())
    ids = local.encode(TEXT, add_special_tokens=True)
    result = server.prefill(ids)
    assert result.first_token == local.prefill(ids).first_token
    assert result.seconds > 0 and result.prompt_tokens == len(ids)
    with pytest.raises(EngineUnsupported, match="verify"):
        server.verify(ids[:3])
    reason = missing([server], ["verify_logits"])
    assert reason and "verify_logits" in reason and "draft rows" in reason
    assert missing([local], ["verify_logits", "route_hits", "first_token_hash"]) is None


def test_one_server_per_selection_never_two_at_once(pool, local):
    registry = pool.registry
    base = pool.engine(registry.engine_selection())
    cand = pool.engine(registry.engine_selection([FP16]))
    base.encode("x")
    first = pool.process.pid
    ids = local.encode(TEXT, add_special_tokens=True)
    got = cand.score(ids)  # starts the candidate's server, stopping the baseline's first
    assert gone(first), "the baseline's server still runs next to the candidate's"
    assert cand.server_info["dflash"]["selection"][FP16.rsplit(".", 1)[0]] == FP16
    assert cand.route_proof()["switches"] == {"DFLASH_PREFILL_GEOMETRY_FP16_Q7920": "1"}
    assert cand.route_hits().get(FP16, 0) > 0, "the server's own counters show the route ran"
    want = ref.build(registry.engine_selection([FP16]), "quick").score(ids)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    base.encode("x")  # and back: the candidate's server is stopped again
    assert len(pool.history) >= 3 and gone(pool.history[-2]["pid"])
    started = len(pool.history)
    proof = cand.route_proof()  # from the counters it reported when stopped: no restart
    assert proof["counters"].get(FP16, 0) > 0 and len(pool.history) == started


def test_a_server_that_exits_is_a_clear_error(tmp_path):
    pool = ServerPool(shipped_registry(), command="sh -c 'echo port {port} taken; exit 3'",
                      startup_timeout_s=30, log_dir=tmp_path)
    with pytest.raises(ServerError) as info:
        pool.engine({}).encode("x")
    message = str(info.value)
    assert "exited before it became healthy" in message and "exit status 3" in message
    assert "echo port" in message and "taken" in message.split("tail:")[1]
    assert gone(pool.history[0]["pid"])
    pool.close()


def test_a_server_that_never_becomes_healthy_is_stopped_and_named(tmp_path):
    pool = ServerPool(shipped_registry(), command="sh -c 'echo starting {port}; sleep 120'",
                      startup_timeout_s=1.5, log_dir=tmp_path)
    with pytest.raises(ServerError, match=r"did not become healthy within 1.5 s.*still running"):
        pool.engine({}).encode("x")
    pid = pool.history[0]["pid"]
    pool.close()
    assert gone(pid), "the hanging server's process group outlived the pool"


HANGS = textwrap.dedent("""
    import http.server, json, sys, time

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body)))
            self.end_headers(); self.wfile.write(body)

        def do_POST(self):
            time.sleep(60)

    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_a_server_that_hangs_on_a_request_is_a_clear_error(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    pool = ServerPool(shipped_registry(), command=f"{sys.executable} {script} {{port}}",
                      startup_timeout_s=60, request_timeout_s=1.0, log_dir=tmp_path)
    with pytest.raises(ServerError, match=r"did not answer POST /tokenize within 1 s"):
        pool.engine({}).encode("x")
    pid = pool.history[0]["pid"]
    pool.close()
    assert gone(pid)


def test_a_switch_the_server_does_not_know_stops_it_at_startup(tmp_path):
    registry = shipped_registry()
    registry.register(Route("prefill.geometry.theirs", "prefill.geometry", "candidate",
                            baseline="prefill.geometry.fp32_q3296", gates=("ppl",),
                            impl="pytest_dflash.engines.geometry:FP32_Q6592"))
    pool = ServerPool(registry, command=SERVE, startup_timeout_s=120, log_dir=tmp_path)
    with pytest.raises(ServerError) as info:
        pool.engine(registry.engine_selection(["prefill.geometry.theirs"])).encode("x")
    message = str(info.value)
    assert "exit status 2" in message and "prefill.geometry.theirs" in message
    assert "--plugin" in message
    pool.close()
