#!/usr/bin/env bash
# Prepared for the next device call (issue 57's report), not yet run on a GPU: the compiled Base step at 4 x 8192,
# packed, with today's default (cuDNN in the global layers) against the one before (varlen_attn everywhere) and
# transformers' ModernBERT compiled, in one run; regional compilation's step and compile seconds; the variable-length
# CLM and MLM after the graph-break fix. Most important first, each bench.py call its own JSON, so that a cut loses
# the last only. From the H200's timings (a Base graph compiles in 45-65 s, a worker takes ~75 s): part 1 ~450 s,
# 2 ~100 s, 3 ~260 s. `bash run5.sh [PART...]` runs those parts (default 1 2 3) in LIMIT seconds: a first call of
# 560 s, then `bash run5.sh 3` (or what the first had no time for) on the warm machine.
# SIZE=tiny SEQ=64 LIMIT=900 BACKENDS="auto sdpa": the same on CPU in ~6 minutes (varlen_attn is CUDA's).
set -u
OUT=${OUT:-/tmp/out}; END=$(( $(date +%s) + ${LIMIT:-560} )); L=$OUT/logs; mkdir -p "$L"
left() { echo $(( END - $(date +%s) )); }
step() {  # NAME SECONDS COMMAND...: its log, exit code and seconds; SIGINT at the limit, SIGKILL 10 s later
    local name=$1 limit=$2 t0; shift 2; t0=$(date +%s)
    [ "$limit" -gt 20 ] || { echo "$name: not run, $limit s left" >> "$OUT/steps.txt"; return; }
    timeout -s INT -k 10 "$limit" "$@" > "$L/$name.log" 2>&1
    echo "$name: exit $? in $(( $(date +%s) - t0 )) s (limit $limit)" >> "$OUT/steps.txt"
}
bench() {  # NAME SECONDS ARGS...: bench.py's step section at the shape, -> OUT/NAME.json
    local name=$1 limit=$2; shift 2
    step "$name" "$limit" python bench.py --size "${SIZE:-base}" --seq_len "${SEQ:-8192}" --batch_size 4 --steps 5 \
        --warmup 2 --skip attention loss data --out "$OUT/$name.json" "$@"
}
cap() { local want=$1 now; now=$(left); echo $(( now - 10 < want ? now - 10 : want )); }  # the smaller, less 10 s
export PYTHONUNBUFFERED=1
(nvidia-smi -L; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())"
 git rev-parse HEAD; git status --short) > "$OUT/env.txt" 2>&1
for part in ${@:-1 2 3}; do case $part in
1)  # packed CLM and MLM: after (auto) and before (varlen) in the same run, transformers compiled; the profile: auto's
    for objective in clm mlm; do
        bench "packed_$objective" "$(cap 250)" --cases packed --objectives "$objective" --impls "ours compiled" \
            "transformers compiled" --attn_backends ${BACKENDS:-auto varlen} --profile "$L/profile"
    done ;;
2)  # regional compilation: its compile seconds and step against 1's
    bench packed_regional "$(cap 100)" --cases packed --objectives clm mlm --impls "ours regional" ;;
3)  # the variable-length case, compiled, after the graph-break fix: 2 graphs expected
    for objective in clm mlm; do
        bench "variable_$objective" "$(cap 130)" --cases variable --objectives "$objective" --impls "ours compiled" \
            "transformers compiled"
    done ;;
*)  echo "unknown part $part (1, 2 or 3)" >> "$OUT/steps.txt" ;;
esac; done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
cat "$OUT/steps.txt"
for f in "$OUT"/*.json; do
    python -c "import json, sys; [print(sys.argv[1].rsplit('/', 1)[1], r['objective'], r['impl'], r['tok/s'], r['MFU'],
r['MFU_6N'], r['warmup_s'], r['compiles'], sep=' | ') for r in json.load(open(sys.argv[1])).get('step', [])]" "$f"
done
ls -R "$OUT"
