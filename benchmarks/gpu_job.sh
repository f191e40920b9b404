#!/usr/bin/env bash
# The GPU measurements behind the h100-*.json result files, in stages, on one CUDA machine whose
# python3 already has a CUDA torch (and transformers for the hf stage). Each stage writes its
# report and log under $WORK; `pack` puts them in $OUT/reports.tgz.
#
#   OUT=out WORK=/tmp/dflash-gpu benchmarks/gpu_job.sh setup build hf selftest main aa pack
#
# setup     install wheels found in .whl/ (with --target, no network), the package (no deps),
#           restore a native-build cache from .dcache/cache.tgz and a Triton kernel cache from
#           .dcache/triton.tgz (fla's and Liger's kernels compile in about 100 s otherwise),
#           and write env.json
# build     build both native variants into $DFLASH_CACHE_DIR (seconds in build.log)
# hf        pytest -m sm70 --dflash-device cuda --dflash-engine hf (ci profile): the six
#           shipped candidates and the kernel libraries' routes inside the Qwen3.5 hybrid
#           (HF_ARGS: more options, e.g. routes or --dflash-dtype; HF_NAME: the report's name)
# hfselftest  the self-test of linear.gdn.fla_chunk inside the Qwen3.5 hybrid (quick profile):
#           its planted defects (state dropped at a chunk seam, q/k L2 norm dropped)
# cudatests the plugin's own tests of CUDA graphs and timing workers (tests/), on cuda
# prefillgraph  eager cold prefills against graph replays of them (benchmarks/prefill_graph.py)
# selftest  the self-test, quick profile, on cuda
# main      the main job, full profile, on cuda (--durations=40)
# aa        the timing calibration self-test 10 times: qpn2_packed's validation_cost A/A copy
#           and its 2% and 5% planted slowdowns (AA_RUNS: how many; AA_NAME: the reports'
#           name, aa by default, so the runs of two calls, e.g. aa and aa2, pool in one folder)
# pack      reports, logs, the build cache and the Triton cache into $OUT
#
# Each stage refreshes $OUT/logs.tgz (every log and stages.log) when it ends, and main, selftest
# and prefillgraph copy their report to $OUT, so a call that is stopped by its own time limit
# still brings back the logs and reports of the stages that finished.
set -u
OUT="${OUT:?set OUT}"
WORK="${WORK:-/tmp/dflash-gpu}"
export DFLASH_CACHE_DIR="${DFLASH_CACHE_DIR:-/tmp/dflash-cache}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-cache}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$WORK" "$DFLASH_CACHE_DIR" "$TRITON_CACHE_DIR"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site

timed() {  # timed NAME LIMIT_S COMMAND...: run, log, and note seconds and exit status
    local name=$1 limit=$2; shift 2
    local start; start=$(date +%s%N)
    echo "== $name: $*" | tee -a "$WORK/stages.log"
    timeout -s INT -k 20 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - start) / 1000000 ))
    echo "$name rc=$rc seconds=$((ms / 1000)).$(( (ms % 1000) / 100 ))" | tee -a "$WORK/stages.log"
    tail -n 25 "$WORK/$name.log"
    # every stage's log in $OUT at once: a call stopped later by its own limit keeps them
    tar -czf "$OUT/logs.tgz" -C "$WORK" --exclude='*.json' . 2>/dev/null
    [ -f "$WORK/env.json" ] && cp "$WORK/env.json" "$OUT/"
}

keep() {  # keep REPORT: a stage's report in $OUT as soon as it is written (a call stopped by
    # its own limit still brings back the reports of the stages that finished)
    [ -f "$1" ] && cp "$1" "$OUT/"
}

for stage in "$@"; do
    case "$stage" in
    setup)
        if compgen -G ".whl/*.whl" > /dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --upgrade --target /tmp/site .whl/*.whl || exit 1
            export PYTHONPATH=/tmp/site
        fi
        python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
        [ -f .dcache/cache.tgz ] && tar -xzf .dcache/cache.tgz -C "$DFLASH_CACHE_DIR"
        [ -f .dcache/triton.tgz ] && tar -xzf .dcache/triton.tgz -C "$TRITON_CACHE_DIR"
        python3 - "$WORK/env.json" <<'EOF'
import json, subprocess, sys, torch, platform
info = {"card": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "cpus": __import__("os").cpu_count()}
from importlib import metadata
for mod, dist in (("transformers", "transformers"), ("triton", "triton"), ("fla", "fla-core"),
                  ("liger_kernel", "liger-kernel"), ("datasets", "datasets")):
    try:
        __import__(mod)
        info[mod] = metadata.version(dist)
    except Exception as exc:  # noqa: BLE001
        info[mod] = f"not importable: {exc}"
info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                 "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip()
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
EOF
        ;;
    build)
        timed build 400 bash -c 'pytest-dflash build --variant full && pytest-dflash build --variant dense_only'
        ;;
    hf)
        timed "${HF_NAME:-hf}" "${HF_LIMIT:-420}" python3 -m pytest -m sm70 \
            --dflash-device cuda --dflash-engine hf --dflash-profile ci -p no:cacheprovider \
            --durations=40 --dflash-report="$WORK/${HF_NAME:-hf}-ci.json" ${HF_ARGS:-}
        ;;
    hfselftest)
        timed hfselftest "${HFSELFTEST_LIMIT:-150}" pytest-dflash selftest \
            "$WORK/hf-selftest.json" --run --dflash-engine hf --dflash-device cuda \
            --dflash-profile quick --dflash-route linear.gdn.fla_chunk -p no:cacheprovider
        ;;
    cudatests)
        timed cudatests "${CUDATESTS_LIMIT:-240}" python3 -m pytest -q -p no:cacheprovider \
            tests/test_timing_graph.py tests/test_timing_workers.py tests/test_engine.py
        ;;
    prefillgraph)
        timed prefillgraph "${PREFILLGRAPH_LIMIT:-240}" python3 benchmarks/prefill_graph.py \
            --out "$WORK/prefill-graph.json" --runs "${PREFILLGRAPH_RUNS:-3}"
        keep "$WORK/prefill-graph.json"
        ;;
    selftest)
        timed selftest "${SELFTEST_LIMIT:-300}" pytest-dflash selftest \
            "$WORK/selftest-quick.json" --run --dflash-profile quick --dflash-device cuda \
            -p no:cacheprovider --durations=20
        keep "$WORK/selftest-quick.json"
        ;;
    main)
        timed main "${MAIN_LIMIT:-420}" python3 -m pytest -m sm70 --dflash-device cuda \
            --dflash-profile full -p no:cacheprovider --durations=40 \
            --dflash-report="$WORK/main-full.json" ${MAIN_ARGS:-}
        keep "$WORK/main-full.json"
        ;;
    aa)
        timed "${AA_NAME:-aa}" "${AA_LIMIT:-540}" pytest-dflash selftest "$WORK/${AA_NAME:-aa}.json" \
            --repeat "${AA_RUNS:-10}" --run --dflash-route gemm.nvfp4.qpn2_packed \
            --dflash-device cuda --dflash-profile "${AA_PROFILE:-full}" -p no:cacheprovider \
            -k "validation_cost_verify_m and (copy or verify_cost_2pct or verify_cost_5pct)"
        ;;
    pack)
        tar -czf "$OUT/reports.tgz" -C "$WORK" .
        tar -czf "$OUT/cache.tgz" -C "$DFLASH_CACHE_DIR" .
        tar -czf "$OUT/triton.tgz" -C "$TRITON_CACHE_DIR" .
        ls -la "$OUT" "$WORK"
        ;;
    *)
        echo "unknown stage $stage"; exit 2 ;;
    esac
done
