#!/usr/bin/env bash
# Prepared for the next device call (issue 57's report, what call5 had no time for), not yet run on a GPU. Sized from
# call5's H200 timings: a bench.py worker of ours at Base 4 x 8192 takes its warm-up (40-57 s compiled) + ~20 s;
# transformers' compiled MLM took over 114 s (on CPU it compiles 5 graphs).
# 1. packed CLM: today's step (the loss's bias gradient a matmul, 076db89) with the profile, then the same tree with
#    support/loss.py as it was before that change (fe14b4a's), in a copy of the tree: ~160 s
# 2. packed MLM, ours compiled, with the profile: ~70 s
# 3. regional compilation, CLM and MLM: its warm-up and step against 1 and 2's: ~130 s
# 4. packed MLM, transformers compiled (call5 measured its CLM: 98k tok/s, ours 2.74x): the rest of the call
# 5. ModernBERT's pretraining length, 32 x 1024 packed, CLM and MLM, ours and transformers compiled: ~250 s
# 6. variable-length CLM and MLM, ours and transformers compiled (2 graphs each expected): ~250 s an objective
# `bash run6.sh [PART...]` (default 1 2 3 4) in LIMIT seconds (default 560); then `bash run6.sh 5` or 6 warm.
# bench.py prints each worker's line as it finishes, so a cut keeps what finished (the logs come back in logs.tgz).
# SIZE=tiny SEQ=64 LIMIT=900: the same on CPU (every part exited 0, 8.5 minutes in all).
set -u
OUT=${OUT:-/tmp/out}; END=$(( $(date +%s) + ${LIMIT:-560} )); L=$OUT/logs; mkdir -p "$L"
left() { echo $(( END - $(date +%s) )); }
step() {  # NAME SECONDS COMMAND...: its log, exit code and seconds; SIGINT at the limit, SIGKILL 10 s later
    local name=$1 limit=$2 t0; shift 2; t0=$(date +%s)
    [ "$limit" -gt 20 ] || { echo "$name: not run, $limit s left" >> "$OUT/steps.txt"; return; }
    timeout -s INT -k 10 "$limit" "$@" > "$L/$name.log" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - t0 )) s (limit $limit)" >> "$OUT/steps.txt"
}
bench() {  # NAME SECONDS [--seq SEQ --bs BS] ARGS...: bench.py's step section -> OUT/NAME.json; BENCH: another tree's
    local name=$1 limit=$2 seq=${SEQ:-8192} bs=4; shift 2
    [ "${1:-}" = --seq ] && { seq=$2; bs=$4; shift 4; }
    step "$name" "$limit" python "${BENCH:-bench.py}" --size "${SIZE:-base}" --seq_len "$seq" --batch_size "$bs" \
        --steps 5 --warmup 2 --skip attention loss data --out "$OUT/$name.json" "$@"
}
cap() { local want=$1 now; now=$(left); echo $(( now - 10 < want ? now - 10 : want )); }  # the smaller, less 10 s
export PYTHONUNBUFFERED=1
(nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"
 git rev-parse HEAD; git status --short) > "$OUT/env.txt" 2>&1
for part in ${@:-1 2 3 4}; do case $part in
1)  bench packed_clm "$(cap 110)" --cases packed --objectives clm --impls "ours compiled" --profile "$L/profile"
    if rm -rf /tmp/before && cp -a . /tmp/before && git show fe14b4a:support/loss.py > /tmp/before/support/loss.py
    then BENCH=/tmp/before/bench.py bench packed_clm_before "$(cap 100)" --cases packed --objectives clm \
        --impls "ours compiled"
    else echo "packed_clm_before: not run, no tree with fe14b4a's loss.py" >> "$OUT/steps.txt"; fi ;;
2)  bench packed_mlm "$(cap 90)" --cases packed --objectives mlm --impls "ours compiled" --profile "$L/profile" ;;
3)  bench packed_regional "$(cap 140)" --cases packed --objectives clm mlm --impls "ours regional" ;;
4)  bench packed_mlm_transformers "$(cap 300)" --cases packed --objectives mlm --impls "transformers compiled" ;;
5)  bench packed_1024 "$(cap 250)" --seq "$(( ${SEQ:-8192} / 8 ))" --bs 32 --cases packed --objectives clm mlm \
        --impls "ours compiled" "transformers compiled" ;;
6)  for objective in clm mlm; do
        bench "variable_$objective" "$(cap 250)" --cases variable --objectives "$objective" --impls "ours compiled" \
            "transformers compiled"
    done ;;
*)  echo "unknown part $part (1 to 6)" >> "$OUT/steps.txt" ;;
esac; done
grep -HE '^  (packed|variable) ' "$L"/*.log  # every finished worker's line, with its run's name
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/steps.txt"
ls "$OUT"
