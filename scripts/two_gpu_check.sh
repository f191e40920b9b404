#!/usr/bin/env bash
# Two-GPU acceptance check of `pytest -n 2` (docs/multi-gpu.md): on a box with at least two
# GPUs of one model, run the gate suite once on one GPU and once with two xdist workers (one GPU
# each), time both, and check that
#   - every route's verdict and every gate's status are the same in both reports,
#   - the two-GPU run ran its timing gates (none refused) and used both cards,
#   - no timing gate (hence no baseline/candidate pair) was measured on more than one card,
#   - both reports have the same shape (keys, node ids, device).
#
# Usage, from the repository root:
#   scripts/two_gpu_check.sh [--profile quick|ci|full] [--part one|two|both] [-- pytest args]
# Reports and logs go to $OUT (default ./two-gpu-check), and each run's live progress of its
# timing gates to $OUT/progress-<run>/<process>.log (main, gw0, gw1: `tail -f` them while it
# runs; --dflash-progress-log). Exit status 0 only if every check holds.
# --part one / --part two run one half (where one call may not run both, e.g. under a time
# limit per command); the checks run once both reports are in $OUT (exit 3 until then).
# DFLASH_CHECK_DEVICE (default cuda) is only for a dry run of this script's plumbing elsewhere.
# The package must be importable; when it is not, it is installed from the checkout (with the
# wheels in .whl/ if that folder exists, for machines without a package index).
set -uo pipefail

profile=full
part=both
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="$2"; shift 2;;
    --part) part="$2"; shift 2;;
    --) shift; extra=("$@"); break;;
    *) echo "unknown argument $1; usage: $0 [--profile quick|ci|full] [--part one|two|both]" \
         "[-- pytest args]"; exit 2;;
  esac
done
case "$part" in one|two|both) ;; *) echo "--part must be one, two or both, got '$part'"; exit 2;; esac
out="${OUT:-$PWD/two-gpu-check}"
device="${DFLASH_CHECK_DEVICE:-cuda}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset DFLASH_FAKE_GPU_COUNT

if ! command -v nvidia-smi >/dev/null; then echo "FAIL: nvidia-smi not found"; exit 2; fi
mapfile -t cards < <(nvidia-smi --query-gpu=index,name,uuid --format=csv,noheader)
printf 'GPU: %s\n' "${cards[@]}"
if [ "${#cards[@]}" -lt 2 ]; then echo "FAIL: this check needs two GPUs, found ${#cards[@]}"; exit 2; fi
uuid0=$(echo "${cards[0]}" | awk -F', ' '{print $3}')
uuid1=$(echo "${cards[1]}" | awk -F', ' '{print $3}')

if ! python3 -c "import importlib.metadata as m; m.distribution('pytest-dflash')" 2>/dev/null; then
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
      .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
python3 -c "import xdist" || { echo "FAIL: pytest-xdist is not installed"; exit 2; }

# Build the native library once, outside both timed runs: both variants, since the loader gate
# links the dense-only one too, and a build inside only one of the timed runs would make the
# comparison unfair.
for variant in full dense_only; do
  CUDA_VISIBLE_DEVICES="$uuid0" pytest-dflash build --variant "$variant" 2>&1 | tail -n 2
done

run() {  # name, CUDA_VISIBLE_DEVICES, pytest arguments...
  local name="$1" visible="$2"; shift 2
  local start end
  rm -rf "$out/progress-$name"  # like $name.log, the progress logs are this run's only
  start=$(date +%s.%N)
  CUDA_VISIBLE_DEVICES="$visible" python3 -m pytest -m sm70 --dflash-device "$device" \
    --dflash-profile "$profile" --dflash-report="$out/$name.json" -p no:cacheprovider -q -rs \
    --dflash-progress-log "$out/progress-$name" "$@" "${extra[@]}" >"$out/$name.log" 2>&1
  local rc=$?
  end=$(date +%s.%N)
  echo "$name: exit $rc, wall $(python3 -c "print(f'{$end - $start:.1f}')") s"
  tail -n 3 "$out/$name.log"
  python3 -c "print($end - $start)" >"$out/$name.wall"
}

[ "$part" = two ] || run one-gpu "$uuid0"
[ "$part" = one ] || run two-gpu "$uuid0,$uuid1" -n 2
for half in one-gpu two-gpu; do
  if [ ! -f "$out/$half.json" ] || [ ! -f "$out/$half.wall" ]; then
    echo "no $half report in $out yet: run the other half with the same OUT, then the checks run"
    exit 3
  fi
done

python3 - "$out" <<'EOF'
import json
import sys
from pathlib import Path

from pytest_dflash import report as reports

EXCLUSIVE = ("speed", "validation_cost")
out = Path(sys.argv[1])
problems = []
one = reports.load(out / "one-gpu.json")
two = reports.load(out / "two-gpu.json")
wall = {n: float((out / f"{n}.wall").read_text()) for n in ("one-gpu", "two-gpu")}

def tests(rep):
    return {t["nodeid"]: (route, kind, t) for route, e in rep["routes"].items()
            for kind, g in e["gates"].items() for t in g["tests"]}

for route, entry in one["routes"].items():
    other = two["routes"].get(route)
    if other is None:
        problems.append(f"{route}: missing from the two-GPU report")
        continue
    if entry["verdict"] != other["verdict"]:
        problems.append(f"{route}: verdict {entry['verdict']} on one GPU, {other['verdict']} on two")
    for kind, gate in entry["gates"].items():
        if gate["status"] != other["gates"][kind]["status"]:
            problems.append(f"{route}:{kind}: {gate['status']} on one GPU, "
                            f"{other['gates'][kind]['status']} on two")

t1, t2 = tests(one), tests(two)
if set(t1) != set(t2):
    problems.append(f"different tests: only one-GPU {sorted(set(t1) - set(t2))[:5]}, "
                    f"only two-GPU {sorted(set(t2) - set(t1))[:5]}")
if set(one) != set(two):
    problems.append(f"top-level keys differ: {sorted(set(one) ^ set(two))}")
for nodeid in set(t1) & set(t2):
    if set(t1[nodeid][2]) != set(t2[nodeid][2]):
        problems.append(f"{nodeid}: test keys differ {sorted(set(t1[nodeid][2]) ^ set(t2[nodeid][2]))}")
        break
for key in ("type", "name", "capability"):
    if one["device"].get(key) != two["device"].get(key):
        problems.append(f"device {key}: {one['device'].get(key)} vs {two['device'].get(key)}")

cards_used, crossed, refused, ran_timing = set(), [], [], 0
for route, entry in two["routes"].items():
    for kind, gate in entry["gates"].items():
        uuids = {t["gpu"]["uuid"] for t in gate["tests"] if t.get("gpu")}
        cards_used |= uuids
        if kind in EXCLUSIVE:
            if len(uuids) > 1:
                crossed.append(f"{route}:{kind} on {sorted(uuids)}")
            for t in gate["tests"]:
                if t["outcome"] == "skipped" and "never share the device" in t["message"]:
                    refused.append(t["nodeid"])
                elif t["outcome"] in ("passed", "failed"):
                    ran_timing += 1
                    if not t.get("gpu"):
                        problems.append(f"{t['nodeid']}: timing test without a GPU record")
if crossed:
    problems.append("timing gates measured on more than one card: " + "; ".join(crossed))
if refused:
    problems.append(f"{len(refused)} timing tests refused under -n 2, e.g. {refused[0]}")
if len(cards_used) != 2:
    problems.append(f"the two-GPU run used {len(cards_used)} card(s): {sorted(cards_used)}")

print()
print(f"profile {one['profile']}, device {one['device'].get('name')}")
print(f"wall time: one GPU {wall['one-gpu']:.1f} s, two GPUs (-n 2) {wall['two-gpu']:.1f} s, "
      f"speedup {wall['one-gpu'] / wall['two-gpu']:.2f}x")
print(f"routes {len(one['routes'])}, tests {len(t1)}, timing tests run on two GPUs {ran_timing}, "
      f"cards used {len(cards_used)}")
print("verdicts: " + ", ".join(f"{r}={e['verdict']}" for r, e in sorted(one["routes"].items())))
for p in problems:
    print(f"FAIL: {p}")
print("RESULT:", "OK" if not problems else f"{len(problems)} problem(s)")
json.dump({"wall_s": wall, "problems": problems}, open(out / "summary.json", "w"), indent=2)
sys.exit(1 if problems else 0)
EOF
