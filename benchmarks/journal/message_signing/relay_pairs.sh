#!/bin/bash
# Relay publishing throughput, signing off/on, interleaved (same tree, same servers kind).
cd /work/wt-authentic
for round in 1 2 3; do
  if [ $((round % 2)) -eq 1 ]; then order="off on"; else order="on off"; fi
  for mode in $order; do
    if [ $mode = on ]; then key=benchmark-key-0123456789abcdefghijklmnop; else key=; fi
    if [ -n "$key" ]; then export PIPELINE_MESSAGE_KEY=$key; else unset PIPELINE_MESSAGE_KEY; fi
    timeout 600 .venv/bin/python -m benchmarks.relay --only throughput \
      --batch-sizes 500 --events 20000 --events-batch1 1000 \
      --output /tmp/bench-authentic/relay_${mode}_${round}.json > /tmp/bench-authentic/relay_${mode}_${round}.out 2>&1
    echo "round $round $mode rc=$?"
  done
done
