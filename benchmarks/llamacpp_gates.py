"""Gate the llama.cpp routes on a llama_cpp.server of a GGUF and write the verdicts and figures
to ``benchmarks/results/llamacpp_gates.json`` (docs/engines.md, "llama.cpp").

    python benchmarks/llamacpp_gates.py --gguf MODEL.gguf [--model HF_DIR] [--profile ci] \
        [--out benchmarks/results/llamacpp_gates.json]

Runs the shipped suites' ppl, quality and prefill speed gates for every route of
``pytest_dflash.engines.llamacpp`` through ``--dflash-serve`` (one llama_cpp.server per
selection), then keeps, per route, the verdict, each gate's status and the figures the gates
recorded (perplexities, bits per byte, pass@1, discordant tasks, the reason a gate is pending).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from pytest_dflash.engines import llamacpp as lc
from pytest_dflash.evidence.verdict import gate_outcome

# the figures kept per test, by the test's function name (the rest stay in the report)
PPL_KEYS = (
    "ppl_baseline",
    "ppl_candidate",
    "max_ppl_rel_delta",
    "ppl_rel_tolerance",
    "bits_per_byte_baseline",
    "bits_per_byte_candidate",
    "max_byte_ppl_rel_delta",
    "ppl_byte_rel_tolerance",
    "segments",
    "tokens",
    "bytes",
    "worst_segment",
)
LONG_PPL_KEYS = (
    "max_band_ppl_rel_delta",
    "ppl_band_rel_tolerance",
    "worst_context",
    "worst_band",
    "context_tokens",
    "band_tokens",
)
QUALITY_KEYS = (
    "tasks",
    "pass_at_1_baseline",
    "pass_at_1_candidate",
    "discordant_baseline_only",
    "discordant_candidate_only",
    "mcnemar_p_regression",
    "contract_failures_baseline",
    "contract_failures_candidate",
    "natural_stop_rate_baseline",
    "natural_stop_rate_candidate",
)
KEYS = {"ppl": PPL_KEYS + LONG_PPL_KEYS, "quality": QUALITY_KEYS}


def short_name(nodeid: str) -> str:
    """The test function of a node id: ``test_ppl.py::test_ppl_long_contexts[r]`` ->
    ``test_ppl_long_contexts``."""
    return nodeid.split("::")[-1].split("[")[0]


def figures(report: dict, route: str) -> dict:
    """The verdict, its reasons and, per gate and test, the outcome and the figures that decided
    it (an error keeps the exception and where it was raised)."""
    entry = report["routes"][route]
    out: dict = {
        "verdict": entry["verdict"],
        "baseline": lc.LLAMACPP_ROUTES[[r.name for r in lc.LLAMACPP_ROUTES].index(route)].baseline,
        "gates": {},
    }
    if entry["verdict"] != "accept":
        out["reasons"] = [reason[:600] for reason in entry.get("reasons", [])]
    for kind, gate in entry["gates"].items():
        item: dict = {"status": gate_outcome(gate), "tests": {}}
        switches: dict = {}
        for test in gate["tests"]:
            m = test.get("measurements") or {}
            row: dict = {"outcome": test["outcome"]}
            row.update({k: m[k] for k in KEYS.get(kind, ()) if k in m})
            if m.get("figure"):
                row["figure"] = m["figure"]
            if test["outcome"] != "passed":
                row["message"] = test.get("message", "")[:600]
            if test.get("raised"):
                row["raised"] = test["raised"]
            item["tests"][short_name(test["nodeid"])] = row
            switches.update({tuple(s["enabled_routes"]): s["switches"]
                             for s in m.get("servers", [])})
        if switches:
            item["server_switches"] = {"+".join(k) or "baseline": v for k, v in switches.items()}
        out["gates"][kind] = item
    return out


def model_info(model: Path | None) -> dict | None:
    """Where the GGUF came from: the checkpoint's path and the sha256 of its weights."""
    if model is None:
        return None
    import hashlib

    weights = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()
    return {
        "model": str(model),
        "model_safetensors_sha256": weights,
        "command": f"python -m dflash_fixtures.convert_gguf {model}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--profile", default="ci")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the transformers checkpoint the GGUF was converted from",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp_gates.json"))
    args = parser.parse_args(argv)

    import llama_cpp

    report = args.out.with_suffix(".report.json")
    routes = [r.name for r in lc.LLAMACPP_ROUTES]
    command = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        "dflash_suites",
        "-m",
        "ppl or quality or prefill",
        "--dflash-profile",
        args.profile,
        "-p",
        "pytest_dflash.engines.llamacpp",
        "--dflash-serve",
        lc.serve_command(args.gguf),
        *[x for name in routes for x in ("--dflash-route", name)],
        "-p",
        "no:cacheprovider",
        "--dflash-every-test",  # the figures of every test, also after a gate has failed
        f"--dflash-report={report}",
    ]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # user+sys of the job and every process it waited for (the servers it started): on an idle
    # machine of n cores the job takes at least this / n, whatever else shares this one
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if run.returncode > 1:
        sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
        return run.returncode
    data = json.loads(report.read_text())
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    import torch

    result = {
        "schema": "pytest-dflash/benchmark/1",
        "kind": "measured",
        "topic": "llama.cpp engine",
        "title": "llama.cpp settings gated as routes on llama_cpp.server",
        "about": "ppl (held-out segments and long contexts), quality and prefill gates of the "
                 "llama.cpp routes, served by llama_cpp.server with the tiny "
                 "Llama-architecture model converted to GGUF; "
                 "gate_job_cpu_seconds is the user+sys time of the job and the servers it "
                 "started (the compile of llama-cpp-python is in llamacpp-compile.json)",
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, "
                   f"llama-cpp-python {llama_cpp.__version__}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": None,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(command[1:]).replace(sys.executable, "python"),
        "values": {
            "gguf": {"name": args.gguf.name, "bytes": args.gguf.stat().st_size,
                     "converted_from": model_info(args.model)},
            "profile": args.profile,
            "exit_status": run.returncode,
            "gate_job_seconds": round(seconds, 1),
            "gate_job_cpu_seconds": round(cpu, 1),
            "routes": {name: figures(data, name) for name in routes},
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # the GGUF's folder of this machine (in the command and the servers' reasons) as the cache
    text = json.dumps(result, indent=1).replace(str(args.gguf.parent), "$DFLASH_CACHE_DIR/gguf")
    args.out.write_text(text + "\n")
    report.unlink()
    print(json.dumps({n: r["verdict"] for n, r in result["values"]["routes"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
