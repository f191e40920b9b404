"""Greedy generation throughput of the reference engine, one task at a time against batches.

    python benchmarks/generation_throughput.py [--device cpu|cuda] [--profile ci|full]
                                               [--tasks N] [--batches 1,16,32]

What the quality gate pays per token (docs/gates.md, "quality"): the profile's coding tasks, the
policy's decoding (greedy, 256 new tokens, the tasks' stop strings), through the baseline
selection. For each batch size it prints the seconds, the tokens, the milliseconds per token
and how many completions equal the first batch size's token for token; batch 1 is
``generate`` once per task, any other ``generate_many``. Each size runs once after a short
warm-up, so the figures are single measurements, not a paired comparison.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_fixtures.tasks import STOP
from pytest_dflash.engines import Sampling
from pytest_dflash.engines.data import coding_tasks
from pytest_dflash.engines.reference import build
from pytest_dflash.policy.thresholds import Policy


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", default="ci", choices=("quick", "ci", "full"))
    parser.add_argument("--tasks", type=int, default=None, help="first N tasks (default: all)")
    parser.add_argument("--batches", default="1,16,32")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if any(b < 1 for b in batches):
        parser.error(f"--batches takes sizes >= 1, got {args.batches!r}")
    tasks = coding_tasks(args.profile)[: args.tasks]
    prompts = [task["prompt"] for task in tasks]
    max_new = Policy().quality_max_new_tokens
    engine = build({}, args.profile, args.device)
    engine.generate_many(prompts[:4], 8, STOP, Sampling(), batch=4)  # warm-up
    first: list[list[int]] | None = None
    for batch in batches:
        _sync(args.device)
        start = time.perf_counter()
        if batch == 1:
            gens = [engine.generate(p, max_new, STOP, Sampling()) for p in prompts]
        else:
            gens = engine.generate_many(prompts, max_new, STOP, Sampling(), batch=batch)
        _sync(args.device)
        seconds = time.perf_counter() - start
        tokens = sum(len(g.token_ids) for g in gens)
        ids = [g.token_ids for g in gens]
        first = first or ids
        same = sum(a == b for a, b in zip(first, ids, strict=True))
        print(f"{args.device} {args.profile} batch {batch:3d}: {len(prompts)} tasks, {tokens} "
              f"tokens, {seconds:.2f} s, {seconds / max(tokens, 1) * 1e3:.2f} ms/token, "
              f"{same}/{len(prompts)} completions equal to batch {batches[0]}'s", flush=True)


if __name__ == "__main__":
    main()
