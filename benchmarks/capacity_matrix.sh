#!/usr/bin/env bash
# The capacity-bound routing benchmarks of docs/benchmarks.md ("Capacity-bound workloads"): documents, multi-turn and
# agentic workloads whose working set exceeds one replica's KV (documents) or the fleet's (multi-turn, agentic), at a
# lighter load and at ~70% of what the fleet sustains, cost vs prefix_affinity vs the SGLang gateway, 3 repeats each;
# then the unique and loaded shared-prefix re-checks. The ~70% rates come from the closed-loop runs of stream
# `calibrate` (70% of each workload's closed-loop throughput, converted to sessions/s for the session workloads).
# Streams run side by side (each bench starts and stops its own processes); results land in OUT/<name>/report.md and
# results.json; each report's copies audit counts each router's copies of held prefixes.
#   benchmarks/capacity_matrix.sh [OUT] [STREAM]   STREAM = calibrate | a | b | c | all (default all: a, b, c)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/capacity}
STREAM=${2:-all}
KVGATE=${KVGATE:-.venv/bin/kvgate}
mkdir -p "$OUT"
COMMON=(--replicas 8 --repeat 3 --no-progress)
ROUTERS=(--policies cost,prefix_affinity --peer sglang)
source benchmarks/workloads.sh

PEER_PORT=29000  # the SGLang gateway's Prometheus port; each stream sets its own so parallel gateways do not clash

run() {  # run NAME ARGS...
  local name=$1; shift
  [ -f "$OUT/$name/results.json" ] && return 0
  echo "$(date -u +%H:%M:%S) start $name"
  "$KVGATE" bench "${COMMON[@]}" "$@" --peer-args "--prometheus-port $PEER_PORT" --out "$OUT/$name" \
    >"$OUT/$name.log" 2>&1
  local rc=$?  # before the date below: a command substitution resets $?
  echo "$(date -u +%H:%M:%S) done $name rc=$rc"
}

calibrate() {  # closed loop (everything at once, 64 in flight, no think time): what the fleet sustains
  local loop=(--policies cost --rate 0 --concurrency 64 --repeat 1)
  run calibrate-docs "${DOCS[@]}" "${TIGHT[@]}" "${loop[@]}"
  run calibrate-turns "${TURNS[@]}" "${TIGHT[@]}" "${loop[@]}" --think-time 0
  run calibrate-agentic "${AGENT[@]}" "${TIGHT[@]}" "${loop[@]}" --think-time 0 --idle-time 0
}

# Rates (wall clock; the engines' clock sees --time-scale times more) at ~70% and ~30% of the closed-loop throughput:
# documents 6.7 req/s -> 4.7 and 2.0 req/s; multi-turn 13.5 req/s -> 1.9 and 0.8 sessions/s (5 requests each);
# agentic 9.4 req/s (bound by its 32 sessions, so a floor on what the fleet sustains) -> 1.1 and 0.45 sessions/s
# (~15 requests each, spread over their pauses). docs-issue is the issue's setup: 30 req/s of engine time, at the
# closed-loop throughput.
stream_a() {
  PEER_PORT=29101
  run docs-70 "${DOCS[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 4.7
  run docs-issue "${DOCS[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 7.5
  run docs-30 "${DOCS[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 2.0
  run unique "${UNIQUE[@]}" --policies cost,least_loaded
}

stream_b() {
  PEER_PORT=29102
  run agentic-70 "${AGENT[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 1.1
  run agentic-30 "${AGENT[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 0.45
}

stream_c() {
  PEER_PORT=29103
  run turns-70 "${TURNS[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 1.9
  run turns-30 "${TURNS[@]}" "${TIGHT[@]}" "${ROUTERS[@]}" --rate 0.8
  run shared-prefix-loaded "${SHARED[@]}" --kv-blocks 16384 "${ROUTERS[@]}"
}

case "$STREAM" in
  calibrate) calibrate ;;
  a) stream_a ;;
  b) stream_b ;;
  c) stream_c ;;
  *) stream_a & stream_b & stream_c & wait ;;
esac
