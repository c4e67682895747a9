#!/usr/bin/env bash
# Soak of the yali configuration on the 70B-class dummy model: one server start, then locust with
# 64 streaming users for SOAK_S seconds (default 360: the longest that fits one 10-minute call after
# a 70B start); PASS needs zero failed requests and no ERROR/Traceback in the server log.
. scripts/gpu_host/env.sh
name="soak-70b-$(date +%Y%m%d)"
work=/tmp/$name
timeout -k 20 580 python3 benchmarks/load_test.py --soak --model-size 70b --users 64 --duration-s "${SOAK_S:-360}" \
  --max-num-seqs 64 --budget-s 560 --out "$work" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -30
cp "$work"/load-test.json "$OUT/$name.json" 2>/dev/null
cp "$work"/load-test.md "$OUT/$name.md" 2>/dev/null && cat "$OUT/$name.md" | head -40
tar czf "$OUT/$name-raw.tgz" -C /tmp "$name"  # locust CSV/HTML, server log
ls -la "$OUT"
