#!/usr/bin/env bash
# Soak of the yali configuration on a dummy model (MODEL_SIZE, default 70b; 8b starts sooner and
# leaves more of a bounded run to the load) at TP ranks (default 2): one server start, then locust with
# 64 streaming users for as long as the budget holds: the run lasts SOAK_S seconds (default 3600),
# shortened by load_test.py to what SOAK_BUDGET_S (default 560 s, from this script's start) leaves
# after the server start and the stop reserve. PASS needs zero failed requests and no
# ERROR/Traceback in the server log. Right after installing the gpu-stack, pass what is left of a
# 10-minute run:
#   bash .gpu-stack/install.sh .gpu-stack > /tmp/install.log && SOAK_BUDGET_S=$((580 - SECONDS)) OUT=$OUT bash lab/gpu_host/soak.sh
# A server's first start compiles (healthy after ~210 s at TP=2 on 2xH200), so 350 s of load or more
# need a run of their own, not one that also installs the stack
# (lab/results/current/soak/20261128-70b-tp2-h200: 206 s of load after install + start;
# an 8b server in a run of its own, MODEL_SIZE=8b SOAK_BUDGET_S=575: 364 s, .../soak/20261128-8b-tp2-h200).
. lab/gpu_host/env.sh
size="${MODEL_SIZE:-70b}"
name="soak-$size-$(date +%Y%m%d)$TP_TAG"
work=/tmp/$name
budget="${SOAK_BUDGET_S:-560}"
timeout -k 20 "$((budget + 20))" python3 -m benchmarks.load_test --soak --model-size "$size" --world-size "$TP" --users 64 --duration-s "${SOAK_S:-3600}" \
  --max-num-seqs 64 --stop-grace-s 15 --budget-s "$budget" --out "$work" 2>&1 | tee "$OUT/$name.log" | grep -v -i warn | tail -30
cp "$work"/load-test.json "$OUT/$name.json" 2>/dev/null
cp "$work"/load-test.md "$OUT/$name.md" 2>/dev/null && cat "$OUT/$name.md" | head -40
tar czf "$OUT/$name-raw.tgz" -C /tmp "$name"  # locust CSV/HTML, server log
ls -la "$OUT"
