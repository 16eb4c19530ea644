#!/usr/bin/env bash
# The standing matrix (docs/benchmarks.md, "The standing matrix"): every workload of benchmarks/workloads.sh, every
# kvgate policy plus the SGLang gateway and smg, REPEATS times each with the order rotated, one bench at a time (run
# it with nothing else on the machine); then benchmarks/matrix_report.py: cost's wins per repeat against every other
# router, per workload, on mean and p99 TTFT.
#   benchmarks/matrix.sh [OUT] [REPEATS] [WORKLOAD ...]   WORKLOAD = docs-tight docs-light trace synth turns agentic
#                                                          shared unique azure trace-late azure-code
#                                                          (default all)
#   POLICIES=cost,prefix_affinity benchmarks/matrix.sh ...  only these kvgate policies (the peers always run)
#   BENCH_ARGS='--gateway-cpus 1' benchmarks/matrix.sh ...  more arguments for every bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/matrix}
REPEATS=${2:-3}
shift 2 2>/dev/null || shift $#
KVGATE=${KVGATE:-.venv/bin/kvgate}
mkdir -p "$OUT"
source benchmarks/workloads.sh
ROUTERS=(--policies "${POLICIES:-cost,prefix_affinity,least_loaded,round_robin}" --peer sglang --peer smg)
read -ra EXTRA <<<"${BENCH_ARGS:-}"
COMMON=(--replicas 8 --repeat "$REPEATS" --no-progress "${ROUTERS[@]}" "${EXTRA[@]}")

run() {  # run NAME ARGS...: skipped when OUT/NAME already has its results
  local name=$1; shift
  [ -f "$OUT/$name/results.json" ] && return 0
  echo "$(date -u +%H:%M:%S) start $name"
  "$KVGATE" bench "${COMMON[@]}" "$@" --out "$OUT/$name" >"$OUT/$name.log" 2>&1
  local rc=$?  # before the date below: a command substitution resets $?
  echo "$(date -u +%H:%M:%S) done $name rc=$rc"
}

# Rates as capacity_matrix.sh calibrated them: documents at the closed-loop throughput (capacity-bound) and at ~30%,
# multi-turn and agentic at ~70%; shared prefixes and unique prompts at their own rates and concurrency caps. The
# traces at 10x are more than the fleet can finish: kvgate's gateway queue would refuse a quarter of the conversation
# trace at its default 30 s deadline while the peers serve everything late, so on both its deadline is raised and
# every router serves (and is timed on) every request.
declare -A WORKLOADS=(
  [docs-tight]="DOCS TIGHT --rate 7.5"
  [docs-light]="DOCS TIGHT --rate 2.0"
  [trace]="TRACE --set admission.deadline_s=600"
  [synth]="SYNTH --set admission.deadline_s=600"
  [turns]="TURNS TIGHT --rate 1.9"
  [agentic]="AGENT TIGHT --rate 1.1"
  [shared]="SHARED --kv-blocks 16384"
  [unique]="UNIQUE"
  [azure]="AZURE"
  [trace-late]="TRACE_LATE --set admission.deadline_s=600"
  [azure-code]="AZURE_CODE"
)
ORDER=(docs-tight docs-light trace synth turns agentic shared unique azure trace-late azure-code)
for name in "${@:-${ORDER[@]}}"; do
  spec=${WORKLOADS[$name]:-}
  [ -n "$spec" ] || { echo "unknown workload $name (one of: ${ORDER[*]})" >&2; exit 2; }
  args=()
  for word in $spec; do
    case $word in
      DOCS|TIGHT|TRACE|SYNTH|TURNS|AGENT|SHARED|UNIQUE|AZURE|TRACE_LATE|AZURE_CODE) declare -n part=$word; args+=("${part[@]}"); unset -n part ;;
      *) args+=("$word") ;;
    esac
  done
  run "$name" "${args[@]}"
done
.venv/bin/python benchmarks/matrix_report.py "$OUT"
