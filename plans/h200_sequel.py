# The H200 study's sequel, stacked after plans/h200.py: the same base, corpora and arms, with
#  - the paper's fine-tuning protocol: 10 epochs (20 for NER), the best epoch by validation macro F1 (suites/study.py
#    leaves both to support/suite.PROTOCOL), 5 fine-tuning seeds (the paper's count for English); lr, batch and
#    warmup stay the small model's (the paper's are for Base);
#  - the pretraining seeds its power figure asks for: from the first run's spread (the pilot, rescaled to 5
#    fine-tuning seeds), a +0.5-point difference on the tasks' average (NCBI-disease and AnatEM: GAD was cut there)
#    is found with 80% power by 9 seeds an arm, on AnatEM by 5, on NCBI-disease by 37:
#      python demo.py plans/h200.py plans/h200_sequel.py --power --pilot results/h200-2026-11-28/study
#   python demo.py plans/h200.py plans/h200_sequel.py
out = "out/study_h200_sequel"
seeds = {"clm": [17, 42, 43, 44, 45, 46, 47, 48, 49], "mlm": [17, 42, 43, 44, 45, 46, 47, 48, 49]}
finetune = {"seeds": [42, 43, 44, 45, 46], "lr": 3e-4, "batch_size": 32, "warmup_ratio": 0.1}
