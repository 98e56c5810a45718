#!/usr/bin/env bash
# One sitting: the peers comparison (pgqueuer, faststream-outbox and pgbench's raw commits)
# on a quiet machine and again beside a CPU hog of one core, the idle pipeline's CPU, the
# tracing overhead, the producer/handler API pairs, ten events per transaction and the
# relay's throughput, each in five rounds, then the relay's wake-up latency, the database
# libraries' costs and a profile of where the CPU goes, quiet and beside the hog (when
# py-spy is installed), back to back on one machine, so that their figures can be compared.
# Each writes its JSON under benchmarks/results/sitting/; this script logs start and end
# times and the load average to its sitting.log, and sitting_summary.py condenses them into
# summary.json and summary.md.
# Run from the repository root with the project's venv: bash benchmarks/sitting.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-5}
DURATION=${DURATION:-10}           # seconds per closed or open loop
EVENTS=${EVENTS:-50000}            # events the relay drains per run
PROFILE_DURATION=${PROFILE_DURATION:-15}
OUT=${OUT:-benchmarks/results/sitting}
mkdir -p "$OUT"
LOG=$OUT/sitting.log
: >"$LOG"
step() {
    echo "$(date -u +%FT%TZ) start $* (load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$LOG"
    "$@"
    echo "$(date -u +%FT%TZ) end (load: $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$LOG"
}
echo "commit $(git rev-parse HEAD)$(git diff --quiet -- pipeline || echo ' with uncommitted pipeline/ changes')" >>"$LOG"
step "$PY" -m benchmarks.peers --rounds "$ROUNDS" --duration "$DURATION" --observability default \
    --output "$OUT/peers.json"
step "$PY" -m benchmarks.peers --rounds "$ROUNDS" --duration "$DURATION" --observability default \
    --contended 1 --output "$OUT/peers_contended.json"
step "$PY" -m benchmarks.end_to_end --only idle --rounds "$ROUNDS" --output "$OUT/idle.json"
step "$PY" -m benchmarks.end_to_end --only throughput --rounds "$ROUNDS" \
    --observability off,default,sampled --events-per-transaction 1 --duration "$DURATION" \
    --output "$OUT/overhead_1_per_tx.json"
# The producer and handler APIs: an ORM Session against a Core connection, order alternating.
for round in $(seq 1 "$ROUNDS"); do
    apis="core session"
    if [ $((round % 2)) -eq 0 ]; then apis="session core"; fi
    for api in $apis; do
        step "$PY" -m benchmarks.end_to_end --only throughput --api "$api" --duration "$DURATION" \
            --events-per-transaction 1 --observability default \
            --output "$OUT/api_${api}_round_$round.json"
    done
done
# Ten events per producer transaction (add_events), as shipped.
for round in $(seq 1 "$ROUNDS"); do
    step "$PY" -m benchmarks.end_to_end --only throughput,latency --rates 1000 --duration "$DURATION" \
        --events-per-transaction 10 --observability default \
        --output "$OUT/ten_per_tx_round_$round.json"
done
for round in $(seq 1 "$ROUNDS"); do
    step "$PY" -m benchmarks.relay --only throughput --batch-sizes 500,1000 --events "$EVENTS" \
        --output "$OUT/relay_round_$round.json"
done
step "$PY" -m benchmarks.relay --only wakeup_latency --sustained-rates 200,1000 \
    --sustained-duration "$DURATION" --output "$OUT/relay_wakeup.json"
step "$PY" -m benchmarks.micro --only drivers --rounds "$ROUNDS" \
    --output "$OUT/dependency_costs.json"
if "$PY" -c "import shutil, sys; sys.exit(0 if shutil.which('py-spy') else 1)" 2>/dev/null \
    || [ -x "$(dirname "$PY")/py-spy" ]; then
    step "$PY" -m benchmarks.end_to_end --only profile --duration "$PROFILE_DURATION" \
        --output "$OUT/profile_split.json"
    "$PY" -c "while True: pass" &  # the contended profile: one core taken by a hog
    HOG=$!
    trap 'kill "$HOG" 2>/dev/null || true' EXIT
    step "$PY" -m benchmarks.end_to_end --only profile --duration "$PROFILE_DURATION" \
        --output "$OUT/profile_split_contended.json"
    kill "$HOG"
fi
"$PY" -m benchmarks.sitting_summary "$OUT"
