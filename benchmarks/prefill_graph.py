"""A cold prefill of the reference engine, eager against one CUDA graph replay of it.

    python benchmarks/prefill_graph.py --out FILE [--lengths 32768,65536] [--runs 5]
        [--routes attn.d256.fa2,gemm.nvfp4.qpn2_packed,prefill.geometry.fp16_q7920]

For each prompt length and each engine (the baseline selection, then each named candidate
switched in), on CUDA at the full profile: the wall time of eager cold prefills (device
synchronized, prefix cache reset before each), and the CUDA-event time of replays of the same
prefill captured in one graph (``ColdPrefillCall``), each after an L2 flush as the gates time.
The ratio eager / replay is how much of an eager prefill is the host launching kernels; the
prefill gate times replays on CUDA (docs/gates.md, "prefill"). Also the seconds the capture
took, the first-token hash of both forms (they must be equal), and the route hits of one run.
Writes a JSON result (benchmarks/results/<card>-prefill-graph.json via gpu_results.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pytest_dflash.engines.data import prompt_ids
from pytest_dflash.engines.factory import EngineFactory
from pytest_dflash.measure import cuda_graphs
from pytest_dflash.measure.timing import cuda_timer
from pytest_dflash.routes import shipped
from pytest_dflash.routes.registry import RouteRegistry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default="32768,65536")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--routes", default="attn.d256.fa2,gemm.nvfp4.qpn2_packed,"
                                            "prefill.geometry.fp16_q7920")
    args = parser.parse_args()
    dev = torch.device("cuda")
    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    factory = EngineFactory(registry, "full", "cuda")
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        for route in ["baseline", *args.routes.split(",")]:
            names = () if route == "baseline" else (route,)
            engine = factory.engine(registry.engine_selection(names))
            ids = prompt_ids(length, engine.encode)
            eager, first_hash = [], None
            for _ in range(args.runs + 1):
                engine.reset_prefix_cache()
                torch.cuda.synchronize(dev)
                began = time.perf_counter()
                result = engine.prefill(ids)
                torch.cuda.synchronize(dev)
                eager.append(time.perf_counter() - began)
                first_hash = result.first_token_hash
            engine.reset_prefix_cache()
            call = engine.cold_prefill_call(ids)
            began = time.perf_counter()
            try:
                captured = cuda_graphs.capture([call], dev, warmup=1)
            except cuda_graphs.CaptureRefused as why:
                rows.append({"length": length, "route": route, "refused": str(why),
                             "eager_s": round(statistics.median(eager[1:]), 4)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            capture_s = time.perf_counter() - began
            replay = captured.replays[0]
            replays = [cuda_timer(replay, dev) for _ in range(args.runs + 1)]
            replay_hash = call.result(captured.outputs[0]).first_token_hash
            row = {"length": length, "route": route, "chunks": call.chunks,
                   "eager_s": round(statistics.median(eager[1:]), 4),
                   "replay_s": round(statistics.median(replays[1:]), 4),
                   "capture_s": round(capture_s, 2),
                   "host_share": round(1 - statistics.median(replays[1:])
                                       / statistics.median(eager[1:]), 3),
                   "same_hash": replay_hash == first_hash}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del captured, call
            torch.cuda.empty_cache()
    json.dump({"card": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "cuda": torch.version.cuda, "runs": args.runs, "rows": rows},
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
