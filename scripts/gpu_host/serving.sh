#!/usr/bin/env bash
# End-to-end serving benchmark of the 70B-class dummy model, bounded by its own
# budget. $1: repeats (default 1), $2: result name suffix (default r1).
# Only 8 files come back from $OUT: the per-point raw files and server logs go
# into one archive.
. scripts/gpu_host/env.sh
name="serving-70b-$(date +%Y%m%d)-${2:-r1}"
work=/tmp/$name
timeout -k 20 575 python3 benchmarks/serving_bench.py --model-size 70b --repeats "${1:-1}" --concurrency 1,8,32 \
  --random-input-len 1024 --random-output-len 256 --max-num-seqs 64 --budget-s 555 --out "$work" 2>&1 \
  | tee "$OUT/$name.log" | tail -45
cp "$work"/serving-benchmark.json "$OUT/$name.json" 2>/dev/null
cp "$work"/serving-benchmark.md "$OUT/$name.md" 2>/dev/null
cp "$work"/*.png "$OUT/" 2>/dev/null
tar czf "$OUT/$name-raw.tgz" -C /tmp "$name"  # per-point JSONs and server-logs/
ls -la "$OUT"
