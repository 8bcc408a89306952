#!/usr/bin/env bash
# bench.py as rewritten on torch.utils.benchmark (its timing) and the profiler's own table, checked on an H200 in the
# device time the study left: Base, 4 x 8192 packed, the CLM step of ours compiled against transformers eager, and
# section 2's kernels on Base's heads. From the repository root: bash results/h200-2026-11-28/bench.sh
set -uo pipefail
OUT=${OUT:-/tmp/bench_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout -s INT 120 python3 bench.py --size base --seq_len 8192 --batch_size 4 --cases packed --objectives clm \
    --impls "ours compiled" transformers --skip attention --min_time 2 --out "$OUT/step_clm.json" 2>&1 \
    | tee "$OUT/step_clm.log"
echo "step: exit ${PIPESTATUS[0]}" | tee -a "$OUT/step_clm.log"
timeout -s INT 60 python3 bench.py --size base --seq_len 8192 --batch_size 4 --cases packed --skip step \
    --attn_kernels varlen cudnn sdpa --min_time 0.3 --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log"
echo "attention: exit ${PIPESTATUS[0]}" | tee -a "$OUT/attention.log"
