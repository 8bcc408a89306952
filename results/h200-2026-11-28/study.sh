#!/usr/bin/env bash
# The study of 2026-11-28 again, from main, in one GPU call, from the repository root:
#   bash results/h200-2026-11-28/study.sh                  # plans/h200.py: about 10 minutes on an H200
#   bash results/h200-2026-11-28/study.sh plans/quick.py   # the same steps, tiny (a CPU dry run)
# The plan reads ../shared/data (the study corpora and the three tasks); on a machine without it, the data travel in
# .study_data/ (ignored by git: a copy of ../shared/data's study/, ncbi_disease, anatem, gad), linked there. Under
# $OUT: env.txt, study.log, and study.tar.gz (the study's folder without weights, shards and texts), packed again
# every 20 s so that a call cut short keeps what ran; the same command on the same folder continues it.
set -uo pipefail
OUT=${OUT:-/tmp/study_out}
STUDY=${STUDY:-/tmp/study}
mkdir -p "$OUT"
if [ ! -e ../shared/data ] && [ -d .study_data ]; then
    mkdir -p ../shared && ln -s "$PWD/.study_data" ../shared/data
fi
{ nvidia-smi; python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"; nproc
  git log -1 --format=%H 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
pack() {
    tar -C "$STUDY" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='tokenizer*.json' \
        --exclude='special_tokens_map.json' --exclude='./text' --exclude='./tasks' -czf "$OUT/study.tmp" . 2>/dev/null \
        && mv "$OUT/study.tmp" "$OUT/study.tar.gz"
}
(while sleep 20; do pack; done) &
packer=$!
PYTHONUNBUFFERED=1 timeout -s TERM "${LIMIT:-525}" python3 demo.py plans/h200.py "$@" --out="$STUDY" 2>&1 \
    | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
kill "$packer"
pack
echo "study.sh: demo.py exit $rc, $(date -u)" | tee -a "$OUT/study.log"
