"""Gate the llama.cpp routes on a llama_cpp.server of a GGUF and write the verdicts and figures
to ``benchmarks/results/llamacpp_gates.json`` (docs/engines.md, "llama.cpp").

    python benchmarks/llamacpp_gates.py --gguf MODEL.gguf [--model HF_DIR] [--profile ci] \
        [--compile-seconds S] [--out benchmarks/results/llamacpp_gates.json]

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
import subprocess
import sys
import time
from pathlib import Path

from pytest_dflash.engines import llamacpp as lc

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


def figures(report: dict, route: str) -> dict:
    entry = report["routes"][route]
    out: dict = {
        "verdict": entry["verdict"],
        "baseline": lc.LLAMACPP_ROUTES[[r.name for r in lc.LLAMACPP_ROUTES].index(route)].baseline,
        "gates": {},
    }
    for kind, gate in entry["gates"].items():
        tests = gate["tests"]
        item: dict = {"status": gate["status"], "outcomes": [t["outcome"] for t in tests]}
        if tests:
            m = tests[0].get("measurements") or {}
            keys = PPL_KEYS if kind == "ppl" else QUALITY_KEYS if kind == "quality" else ()
            item.update({k: m[k] for k in keys if k in m})
            item["figures"] = [t.get("measurements", {}).get("figure", "") for t in tests]
            if tests[0]["outcome"] != "passed":
                item["message"] = tests[0].get("message", "")[:600]
            switches = {tuple(s["enabled_routes"]): s["switches"] for s in m.get("servers", [])}
            if switches:
                item["server_switches"] = {
                    "+".join(k) or "baseline": v for k, v in switches.items()
                }
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
        "--compile-seconds",
        type=float,
        default=None,
        help="measured wall time of pip install 'llama-cpp-python[server]'",
    )
    parser.add_argument("--compile-note", default="")
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
        "ppl or quality or speed",
        "--dflash-profile",
        args.profile,
        "-p",
        "pytest_dflash.engines.llamacpp",
        "--dflash-serve",
        lc.serve_command(args.gguf),
        *[x for name in routes for x in ("--dflash-route", name)],
        "-p",
        "no:cacheprovider",
        "--dflash-report",
        str(report),
    ]
    start = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
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
        "about": "ppl, quality and speed gates of the llama.cpp routes, served by "
                 "llama_cpp.server with the tiny Llama-architecture model converted to GGUF; "
                 "the compile time of llama-cpp-python from source is in compile.seconds",
        "machine": f"{platform.platform()}, {os.cpu_count()} CPUs, "
                   f"llama-cpp-python {llama_cpp.__version__}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": None,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(command[1:]).replace(sys.executable, "python")
                   .replace(str(args.gguf.parent), "$DFLASH_CACHE_DIR/gguf"),
        "values": {
            "gguf": {"name": args.gguf.name, "bytes": args.gguf.stat().st_size,
                     "converted_from": model_info(args.model)},
            "profile": args.profile,
            "exit_status": run.returncode,
            "gate_job_seconds": round(seconds, 1),
            "compile": {"seconds": args.compile_seconds, "note": args.compile_note},
            "routes": {name: figures(data, name) for name in routes},
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    report.unlink()
    print(json.dumps({n: r["verdict"] for n, r in result["values"]["routes"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
