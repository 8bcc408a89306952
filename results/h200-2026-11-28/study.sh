#!/usr/bin/env bash
# The study (issue 79) in one GPU call, from the repository root:
#   bash results/h200-2026-11-28/study.sh                # the run: about 8.5 minutes on an H200
#   bash results/h200-2026-11-28/study.sh --quick        # the same steps, tiny (a CPU dry run)
# The data travel in .study_data/ (ignored by git; copied from ../shared/data: study/*.txt.xz, ncbi_disease, anatem,
# gad). Under $OUT: env.txt, study.log, and study.tar.gz (the run's folder without weights, shards and texts),
# packed again every 20 s so that a call cut short keeps what ran.
set -uo pipefail
OUT=${OUT:-/tmp/study_out}
STUDY=/tmp/study
mkdir -p "$OUT"
rm -rf "$STUDY"
{ nvidia-smi; python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)"; nproc
  git log -1 --format=%H 2>/dev/null; date -u; } > "$OUT/env.txt" 2>&1
pack() {
    tar -C "$STUDY" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' --exclude='tokenizer*.json' \
        --exclude='special_tokens_map.json' --exclude='./text' -czf "$OUT/study.tmp" . 2>/dev/null \
        && mv "$OUT/study.tmp" "$OUT/study.tar.gz"
}
(while sleep 20; do pack; done) &
packer=$!
PYTHONUNBUFFERED=1 timeout -s TERM "${LIMIT:-525}" python3 demo.py --study .study_data --out "$STUDY" "$@" 2>&1 \
    | tee "$OUT/study.log"
rc=${PIPESTATUS[0]}
kill "$packer"
pack
echo "study.sh: demo.py exit $rc, $(date -u)" | tee -a "$OUT/study.log"
