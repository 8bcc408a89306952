#!/usr/bin/env bash
# The third device call (a new session, the same day): issue 54's remainder. The CUDA resume test with moving weights
# and part c at tiny sizes (its torchrun resume run to its exit) side by side, both small; then demo.py --quick to its
# report; then bench.py's variable-length CLM at Base, alone on the GPU. At most 8 files under $OUT (the device's
# limit): every log goes into logs.tgz. SIZE=tiny SEQ=64: the same on CPU in a minute or two.
set -u
OUT=${OUT:-/tmp/out}; D=/tmp/demo_$$; END=$(( $(date +%s) + ${LIMIT:-580} )); L=$OUT/logs; mkdir -p "$L"
left() { echo $(( END - $(date +%s) )); }
step() {  # NAME SECONDS COMMAND...: its log, exit code and seconds; SIGINT at the limit, SIGKILL 10 s later
    local name=$1 limit=$2 t0; shift 2; t0=$(date +%s)
    [ "$limit" -gt 20 ] || { echo "$name: not run, $limit s left" >> "$OUT/steps.txt"; return; }
    timeout -s INT -k 10 "$limit" "$@" > "$L/$name.log" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - t0 )) s (limit $limit)" >> "$OUT/steps.txt"
}
export PYTHONUNBUFFERED=1
(nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"
 git rev-parse HEAD; git status --short) > "$OUT/env.txt" 2>&1
step resume_test 170 python -m pytest tests/test_gpu.py -k resume -o addopts= -rA -p no:cacheprovider --durations=0 &
step check_c 230 python tests/gpu_check.py --tiny --parts c --budget c=180 --out "$OUT/check_c"
wait
step demo $(( $(left) < 260 ? $(left) : 260 )) python demo.py --quick --out "$D"
cp "$D/report.md" "$OUT/demo_report.md" 2>/dev/null
step bench_variable_clm $(( $(left) - 15 )) python bench.py --size ${SIZE:-base} --seq_len ${SEQ:-8192} \
    --batch_size 4 --steps 5 --warmup 2 --cases variable --objectives clm --skip attention loss data \
    --out "$OUT/bench_variable_clm.json"
mv "$OUT/check_c/logs" "$L/check_c" 2>/dev/null; cp -r "$D/logs" "$L/demo" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/steps.txt"
tar xzf "$OUT/logs.tgz" -O logs/resume_test.log | tail -n 8
head -n 12 "$OUT/check_c/report.md" | cut -c1-400; tail -n 12 "$OUT/demo_report.md" 2>/dev/null | cut -c1-300
tar xzf "$OUT/logs.tgz" -O logs/bench_variable_clm.log | tail -n 12; ls -R "$OUT"
