"""The figures behind the seam gates (docs/gates.md, "ppl" long contexts and "speed" agreement).

    python benchmarks/seam_figures.py [--profile ci] [--device cpu] [--spread] [--out FILE]

For each geometry route (shipped candidates and the planted seam defects of
``pytest_dflash.selftest.seam_defects``) against the family baseline, on the profile's sizes:

- the long contexts' perplexity per position band (the ppl gate's long-context test), and the
  largest band difference;
- after each cold prefill of the speed gate's prompts: whether the greedy next token agrees,
  and the largest KL(candidate || baseline) at the positions after every seam and on the verify
  rows decoded on top of the prefill (the agreement test).

With ``--positions`` only the baseline's perplexity by position (buckets 0-511, 512-1023, ...,
doubling) over the profile's first long context: how the model, trained on 512-token
sequences, predicts far beyond that.

With ``--spread`` also the spread that the agreement bound derives from: KL(fp32 engine ||
fp64 reference) and KL(fp16-compute engine || fp64 reference) at the same positions, where the
fp64 reference runs the oracle attention and GEMM routes, an fp64 SSM state and fp64 arithmetic.
Results go to ``--out`` as JSON (machine, torch, commit, command, values).
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
from typing import Any

import torch

from pytest_dflash.engines import reference
from pytest_dflash.engines.data import long_contexts, prompt_ids
from pytest_dflash.engines.geometry import REFERENCE_FP64
from pytest_dflash.metrics.seam_bands import agreement_positions, band_perplexities, bands
from pytest_dflash.policy.profiles import sizes
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route, RouteRegistry
from pytest_dflash.routes.shipped import SHIPPED_FAMILIES, SHIPPED_ROUTES
from pytest_dflash.selftest.seam_defects import (
    BF16_Q7920,
    FP8_Q7920,
    LastChunkKVDropped,
    StateZeroedAtSeams,
)

GEOMETRY = "prefill.geometry"
BASELINE = f"{GEOMETRY}.fp32_q3296"


def registry() -> RouteRegistry:
    reg = RouteRegistry()
    for family in SHIPPED_FAMILIES:
        reg.declare(family)
    for route in SHIPPED_ROUTES:
        reg.register(route)
    for geometry in (BF16_Q7920, FP8_Q7920, REFERENCE_FP64):
        reg.register(
            Route(
                geometry.name,
                GEOMETRY,
                "candidate",
                baseline=BASELINE,
                gates=("ppl",),
                impl=geometry,
            )
        )
    return reg


# route label -> (engine class, geometry route)
ROUTES: dict[str, tuple[type, str]] = {
    "fp32_q6592": (reference.ReferenceEngine, f"{GEOMETRY}.fp32_q6592"),
    "fp16_q7920": (reference.ReferenceEngine, f"{GEOMETRY}.fp16_q7920"),
    "defect: bf16 state (Q7920)": (reference.ReferenceEngine, BF16_Q7920.name),
    "defect: fp8 e4m3 state (Q7920)": (reference.ReferenceEngine, FP8_Q7920.name),
    "defect: state zeroed at seams (Q7920)": (StateZeroedAtSeams, f"{GEOMETRY}.fp16_q7920"),
    "defect: last chunk's KV dropped (Q7920)": (LastChunkKVDropped, f"{GEOMETRY}.fp16_q7920"),
}


def kl_rows(cand: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """KL(cand || base) per row of two log-prob matrices (fp64)."""
    return (cand.exp() * (cand - base)).sum(-1)


def log_probs(rows: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(rows.double().cpu(), dim=-1)


def agreement(
    engine: Any, ids: list[int], cont: list[int], positions: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    at = engine.prefill_logits(ids, positions)
    return at, log_probs(engine.verify(cont))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--spread", action="store_true")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--positions", action="store_true")
    parser.add_argument(
        "--lengths",
        type=int,
        nargs="*",
        help="prompt lengths (default: the profile's prefill_lengths)",
    )
    parser.add_argument(
        "--compute",
        choices=("float32", "float16"),
        default=None,
        help="compute dtype of every engine (default: the device's)",
    )
    parser.add_argument("--routes", nargs="*", help="labels of ROUTES to measure (default all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    policy, size, reg = Policy(), sizes(args.profile), registry()
    torch.manual_seed(0)

    def build(cls: type, geometry: str, **kw: Any) -> Any:
        if args.compute and "compute_dtype" not in kw:
            kw["compute_dtype"] = getattr(torch, args.compute)
        return cls(
            {**reg.engine_selection(), GEOMETRY: geometry, **kw.pop("sel", {})},
            args.profile,
            args.device,
            registry=reg,
            **kw,
        )

    base = build(reference.ReferenceEngine, BASELINE)
    if args.positions:
        return write(args, positions_by_bucket(base, args.profile, size.ppl_long_tokens))
    engines = {
        label: build(cls, geo)
        for label, (cls, geo) in ROUTES.items()
        if not args.routes or label in args.routes
    }
    chunks = {label: e.chunk for label, e in engines.items()}
    values: dict[str, Any] = {
        "profile": args.profile,
        "device": args.device,
        "baseline": BASELINE,
        "chunks": chunks,
        "baseline_chunk": base.chunk,
        "compute": str(base.dtype).removeprefix("torch."),
        "routes": {},
    }
    t0 = time.perf_counter()
    # ------------------------------------------------------------------ agreement
    rows = policy.agreement_rows
    prompts = {}
    for length in args.lengths or size.prefill_lengths:
        full = prompt_ids(length + rows, base.encode)
        ids, cont = full[:length], full[length:]
        positions = agreement_positions(length, [base.chunk, *set(chunks.values())], rows)
        prompts[length] = (ids, cont, positions, agreement(base, ids, cont, positions))
    for label, engine in engines.items():
        entry = values["routes"].setdefault(label, {})
        for length, (ids, cont, positions, (b_at, b_ver)) in prompts.items():
            c_at, c_ver = agreement(engine, ids, cont, positions)
            kl_at, kl_ver = kl_rows(c_at, b_at), kl_rows(c_ver, b_ver)
            entry.setdefault("agreement", {})[str(length)] = {
                "greedy_next_token_equal": int(c_at[-1].argmax()) == int(b_at[-1].argmax()),
                "max_kl_after_seams": float(kl_at.max()),
                "max_kl_verify_rows": float(kl_ver.max()),
                "verify_rows_argmax_equal": int((c_ver.argmax(-1) == b_ver.argmax(-1)).sum()),
                "positions": len(positions),
            }
        print(label, json.dumps(entry["agreement"]), flush=True)
    if args.spread:
        ref = build(
            reference.ReferenceEngine,
            REFERENCE_FP64.name,
            compute_dtype=torch.float64,
            sel={"attn.d256": "attn.d256.oracle", "gemm.nvfp4": "gemm.nvfp4.oracle"},
        )
        half = build(reference.ReferenceEngine, BASELINE, compute_dtype=torch.float16)
        spread: dict[str, Any] = {}
        for length, (ids, cont, positions, (b_at, b_ver)) in prompts.items():
            r_at, r_ver = agreement(ref, ids, cont, positions)
            h_at, h_ver = agreement(half, ids, cont, positions)
            spread[str(length)] = {
                "fp32_vs_fp64": {
                    "max_kl": max(
                        float(kl_rows(b_at, r_at).max()), float(kl_rows(b_ver, r_ver).max())
                    ),
                    "median_kl": float(
                        torch.cat([kl_rows(b_at, r_at), kl_rows(b_ver, r_ver)]).median()
                    ),
                },
                "fp16_vs_fp64": {
                    "max_kl": max(
                        float(kl_rows(h_at, r_at).max()), float(kl_rows(h_ver, r_ver).max())
                    ),
                    "median_kl": float(
                        torch.cat([kl_rows(h_at, r_at), kl_rows(h_ver, r_ver)]).median()
                    ),
                },
                "positions": len(positions) + len(cont),
            }
            print("spread", length, json.dumps(spread[str(length)]), flush=True)
        values["reference_spread"] = spread
    # ------------------------------------------------------------------ long contexts
    if not args.skip_long:
        need = max(size.ppl_long_tokens, 3 * max(*chunks.values(), base.chunk) + 2)
        contexts = long_contexts(args.profile, base.encode, need)
        base_lp = {c["id"]: base.score(c["ids"]) for c in contexts}
        values["long_contexts"] = {c["id"]: len(c["ids"]) for c in contexts}
        for label, engine in engines.items():
            entry = values["routes"][label]
            out = {}
            for c in contexts:
                cand_lp = engine.score(c["ids"])
                cuts = bands(len(c["ids"]), engine.chunk, policy.ppl_band_tokens)
                pb = band_perplexities(base_lp[c["id"]], cuts)
                pc = band_perplexities(cand_lp, cuts)
                out[c["id"]] = [
                    {
                        "band": b.label,
                        "positions": [b.start, b.end],
                        "ppl_baseline": round(x, 6),
                        "ppl_candidate": round(y, 6),
                        "delta": round(y - x, 6),
                    }
                    for b, x, y in zip(cuts, pb, pc, strict=True)
                ]
            entry["long_context_bands"] = out
            entry["max_band_delta"] = max(abs(b["delta"]) for rows_ in out.values() for b in rows_)
            print(label, "max band delta", entry["max_band_delta"], flush=True)
    values["seconds"] = round(time.perf_counter() - t0, 1)
    write(args, values)


def positions_by_bucket(base: Any, profile: str, tokens: int) -> dict[str, Any]:
    """The baseline's perplexity per doubling position bucket of the first long context."""
    import math

    t0 = time.perf_counter()
    context = long_contexts(profile, base.encode, tokens)[0]
    logprobs = base.score(context["ids"])
    buckets, lo = [], 0
    while lo < len(logprobs):
        hi = min(len(logprobs), 512 if lo == 0 else 2 * lo)
        part = logprobs[lo:hi]
        buckets.append({"positions": [lo, hi], "ppl": round(math.exp(-sum(part) / len(part)), 4)})
        lo = hi
    print(json.dumps(buckets), flush=True)
    return {
        "profile": profile,
        "baseline": BASELINE,
        "chunk": base.chunk,
        "context": context["id"],
        "tokens": len(context["ids"]),
        "trained_sequence_tokens": 512,
        "ppl_by_position": buckets,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def machine(device: str) -> str:
    """CPU model and core count (and the GPU's name on CUDA), for the result file."""
    model = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    text = f"{os.cpu_count()}-core {model}"
    if device.startswith("cuda"):
        text += f", {torch.cuda.get_device_name(torch.device(device))}"
    return text


def write(args: argparse.Namespace, values: dict[str, Any]) -> None:
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
        result = {
            "schema": "pytest-dflash/benchmark/1",
            "kind": "measured",
            "topic": "seam gates",
            "title": f"Seam figures of the prefill.geometry routes ({args.profile})",
            "machine": machine(args.device),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "cuda": torch.version.cuda if args.device.startswith("cuda") else None,
            "commit": commit,
            "command": "python " + " ".join(sys.argv),
            "values": values,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
