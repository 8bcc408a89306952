#!/usr/bin/env bash
# The one-off measurements of bench.py at f5a04df (its sections share, freeze, finetune_memory, 3 and 4), before they
# left the code; run from a copy of that tree on an idle 2-core machine.
set -u
cd /tmp/oldtree
O=/tmp/oneoff
python bench.py freeze --out $O/freeze.json > $O/freeze.log 2>&1; echo "freeze $?"
python bench.py finetune_memory --size small --seq_len 2048 --out $O/finetune_memory.json > $O/finetune_memory.log 2>&1; echo "finetune_memory $?"
python bench.py --skip step attention --lengths_from /work/shared/data/biomed_sentences.txt --tokenizer /work/shared/tokenizers/modernbert/tokenizer.json --out $O/loss_data.json > $O/loss_data.log 2>&1; echo "loss+data $?"
python bench.py share --out $O/share.json > $O/share.log 2>&1; echo "share $?"
