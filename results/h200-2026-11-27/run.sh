#!/usr/bin/env bash
# The one device call of 2026-11-27: issue 54's parts c and e of the GPU check, then, in what is left of LIMIT
# seconds, the CUDA resume test and issue 57's attention table. Writes 8 files under $OUT (the device's limit).
set -u
OUT=${OUT:-/tmp/out}; END=$(( $(date +%s) + ${LIMIT:-525} ))
left() { echo $(( END - $(date +%s) )); }
export PYTHONUNBUFFERED=1
(nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"
 git rev-parse HEAD) > "$OUT/env.txt" 2>&1
python tests/gpu_check.py ${TINY:+--tiny} --parts c e --budget c=${C:-290} e=${E:-210} --out "$OUT/check_ce" \
    > "$OUT/check_ce.log" 2>&1
L=$(left); [ "$L" -gt 90 ] && timeout $(( L - 40 )) python -m pytest tests/test_gpu.py -k resume -o addopts= -rA \
    -p no:cacheprovider --durations=0 > "$OUT/resume.log" 2>&1
L=$(left); [ "$L" -gt 60 ] && timeout $(( L - 15 )) python bench.py --size ${SIZE:-base} --seq_len ${SEQ:-8192} \
    --batch_size 4 --steps 5 --warmup 2 --skip step loss data --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
tar czf "$OUT/logs.tgz" -C "$OUT/check_ce" logs && rm -rf "$OUT/check_ce/logs"
tail -n 45 "$OUT/check_ce.log"; tail -n 25 "$OUT"/resume.log "$OUT"/attention.log 2>/dev/null; ls -R "$OUT"
