# The paper's 8 French biomedical tasks, with its 9 seeds (42-50).
#   python eval.py --suite suites/fr_bio.py --models out/fr_base/final out/fr_base_mlm/final --out out/eval_fr
# The paper's French fine-tuning hyperparameters are not known to us: it states its protocol for English only
# (after BioClinical-ModernBERT) and, for French, the tasks and the 9 seeds. This suite therefore uses the English
# protocol (support/suite.PROTOCOL, each value with its source: lr 5e-5, batch 16, weight decay 0.01, 10 epochs, 20
# for NER, no warmup, linear decay, the model's full context, best epoch by validation macro F1) as our choice,
# not as the paper's French values; set a task's keys where you know better. The table reports test macro F1,
# mean over the seeds.
#
# The datasets are not downloaded for you. Convert each to a folder with train / dev (or validation) / test
# splits in eval.py's formats: cls {"text", "label"} JSONL, multilabel {"text", "labels": [...]} JSONL, ner
# CoNLL (token TAB BIO-tag, blank line between sentences) or {"tokens", "tags"} JSONL. Check the task type
# against your conversion: a coding task kept as the set of its codes per document is multilabel.
# The released ModernCamemBERT-bio model card reports FrACCO twice (its 30 and its 100 most frequent codes)
# and no MorFITT; for that table, add a second FrACCO entry with the 100-code labels in place of MorFITT.

seeds = [42, 43, 44, 45, 46, 47, 48, 49, 50]

DATA = "../data/fr_bio"  # <- where your converted tasks are; a relative path is relative to this file's folder

tasks = [
    # DiaMED: French clinical cases classified by ICD-10 chapter; part of DrBenchmark (Labrak et al. 2024),
    # huggingface.co/datasets/DrBenchmark/DiaMED; licence on its dataset card.
    dict(name="diamed", task="cls", data=f"{DATA}/diamed"),
    # FrACCO: French clinical oncology documents with ICD-O-3 codes, here the codes of each document;
    # huggingface.co/datasets/rntc/fracco (as the model card names it); terms on its dataset card.
    dict(name="fracco", task="multilabel", data=f"{DATA}/fracco"),
    # QUAERO French Medical Corpus, EMEA part: drug leaflets, 10 UMLS semantic groups (Névéol et al. 2014),
    # GNU FDL; nested entities flattened to BIO, as in DrBenchmark (DrBenchmark/QUAERO).
    dict(name="quaero_emea", task="ner", data=f"{DATA}/quaero_emea"),
    # QUAERO, MEDLINE part: titles of MEDLINE abstracts, same 10 groups, same licence and conversion.
    dict(name="quaero_medline", task="ner", data=f"{DATA}/quaero_medline"),
    # MorFITT: the medical specialties of a French PubMed abstract, several per abstract (Labrak et al.
    # 2023), in DrBenchmark (DrBenchmark/MORFITT); licence on its dataset card.
    dict(name="morfitt", task="multilabel", data=f"{DATA}/morfitt"),
    # CANTEMIST: oncology clinical cases with their eCIE-O (ICD-O) morphology codes (Barcelona Supercomputing
    # Center, CANTEMIST-CODING; Spanish original CC BY 4.0, bigbio/cantemist); a French version, codes per
    # document; check the terms of the version you use.
    dict(name="cantemist", task="multilabel", data=f"{DATA}/cantemist"),
    # DisTEMIST: disease mentions of clinical cases and their SNOMED CT codes (BSC); its multilingual release
    # has French translations; here the codes per document. Terms on its Zenodo record.
    dict(name="distemist", task="multilabel", data=f"{DATA}/distemist"),
    # MedDialog: patient-doctor dialogues in French, classified (e.g. by specialty); see the dataset card
    # of the version you use for its source and licence.
    dict(name="meddialog", task="cls", data=f"{DATA}/meddialog"),
]
