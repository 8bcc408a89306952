#!/usr/bin/env bash
# The second device call: part c at tiny sizes on the GPU (compiled train.py under torchrun/NCCL, SIGTERM, resumed
# to its end; a fresh machine compiles Base too slowly for what was left), then demo.py --quick in the time left.
set -u
OUT=${OUT:-/tmp/out}; END=$(( $(date +%s) + ${LIMIT:-245} ))
left() { echo $(( END - $(date +%s) )); }
export PYTHONUNBUFFERED=1
python tests/gpu_check.py --tiny --parts c --budget c=${C:-140} --out "$OUT/check_tiny_c" > "$OUT/check_tiny_c.log" 2>&1
L=$(left); [ "$L" -gt 30 ] && timeout $(( L - 8 )) python demo.py --quick --out /tmp/demo > "$OUT/demo.log" 2>&1
echo "demo exit $?" >> "$OUT/demo.log"; cp /tmp/demo/report.md "$OUT/demo_report.md" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT/check_tiny_c" logs && rm -rf "$OUT/check_tiny_c/logs"
tail -n 30 "$OUT/check_tiny_c.log"; tail -n 12 "$OUT/demo.log"; ls -R "$OUT"
