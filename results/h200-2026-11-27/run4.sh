#!/usr/bin/env bash
# The fourth device call, on the machine run3.sh left warm: issue 57's attention table (bench.py's section 2: each
# kernel on global and local layers, bidirectional and causal, packed and documents kept apart, at train.py's Base
# shape, against SDPA in float32), in LIMIT seconds. SIZE=tiny SEQ=64: the same on CPU.
set -u
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
(nvidia-smi -L; git rev-parse HEAD) > "$OUT/env4.txt" 2>&1
timeout -s INT -k 10 "${LIMIT:-240}" python bench.py --size ${SIZE:-base} --seq_len ${SEQ:-8192} --batch_size 4 \
    --steps 5 --warmup 2 --skip step loss data --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
echo "bench.py attention: exit $?" >> "$OUT/attention.log"
tail -n 40 "$OUT/attention.log"
