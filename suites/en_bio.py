# The paper's 11 English biomedical tasks (5 clinical, after BioClinical-ModernBERT, and 6 from BigBIO/BLURB).
#   python eval.py --suite suites/en_bio.py --models out/en_base/final out/en_base_mlm/final --out out/eval_en
# Every key a task leaves out is the protocol (support/suite.PROTOCOL, each value with its source): from the paper
# lr 5e-5, batch 16, weight decay 0.01, 10 epochs (20 for NER); from the protocol it follows (BioClinical-ModernBERT,
# Hugging Face Trainer defaults) no warmup and a linear decay, examples truncated only at the model's maximum length
# (8,192 tokens for ModernBERT); the best epoch by validation macro F1, the reported metric. The table reports test
# macro F1, mean over the seeds. Seeds: the paper runs 5 for English; these five are our choice.
#
# The datasets are not downloaded for you: several need a data-use agreement. Convert each to a folder
# with train / dev (or validation) / test splits in eval.py's formats: cls {"text", "label"} JSONL,
# multilabel {"text", "labels": [...]} JSONL, ner CoNLL (token TAB BIO-tag, blank line between sentences)
# or {"tokens", "tags"} JSONL. eval.py checks every folder before training anything.

seeds = [42, 43, 44, 45, 46]

DATA = "../data/en_bio"  # <- where your converted tasks are; a relative path is relative to this file's folder

tasks = [
    # ChemProt (BioCreative VI): the chemical-protein relation of a sentence with both entities marked.
    # BLUE benchmark's split, github.com/ncbi-nlp/BLUE_Benchmark (release 0.1, bert_data.zip); also bigbio/chemprot.
    # Public download for research; see BioCreative's terms.
    dict(name="chemprot", task="cls", data=f"{DATA}/chemprot"),
    # Phenotype: patient phenotypes (advanced cancer, depression, obesity, ...) of MIMIC-III discharge notes,
    # several per note. physionet.org/content/phenotype-annotations-mimic/1.20.03 plus MIMIC-III's
    # NOTEEVENTS.csv; credentialed PhysioNet access (training course, data-use agreement). Long notes: read
    # whole up to the model's 8,192 tokens (the followed protocol's truncation), in micro batches of max_tokens.
    dict(name="phenotype", task="multilabel", data=f"{DATA}/phenotype"),
    # COS: change-of-status events in radiology reports (University of Washington BioNLP),
    # depts.washington.edu/bionlp/data/corpora/files/events-COS-corpus.zip; BRAT spans converted to BIO.
    # Terms in the archive.
    dict(name="cos", task="ner", data=f"{DATA}/cos"),
    # Social History: substance use and other social-history events in MTSamples notes (UW BioNLP),
    # depts.washington.edu/bionlp/data/corpora/files/SocialHistoryMTSamples.zip; BRAT spans converted to BIO.
    # Terms in the archive.
    dict(name="social_history", task="ner", data=f"{DATA}/social_history"),
    # DEID: protected health information in clinical notes. BioClinical-ModernBERT uses PhysioNet's
    # "Deidentified Medical Text" (physionet.org/content/deidentifiedmedicaltext/1.0); the released
    # model cards name the n2c2 2006 de-identification data (n2c2 data-use agreement, DBMI portal).
    dict(name="deid", task="ner", data=f"{DATA}/deid"),
    # AnatEM: anatomical entities in PubMed/PMC text (Pyysalo & Ananiadou 2014), CC BY-SA 3.0; a CoNLL
    # version is in github.com/cambridgeltl/MTL-Bioinformatics-2016 (data/AnatEM-IOB).
    dict(name="anatem", task="ner", data=f"{DATA}/anatem"),
    # BC5CDR: chemicals and diseases in PubMed abstracts (BioCreative V CDR); CoNLL version in
    # MTL-Bioinformatics-2016 (data/BC5CDR-IOB); public download for research, see BioCreative's terms.
    dict(name="bc5cdr", task="ner", data=f"{DATA}/bc5cdr"),
    # JNLPBA: protein, DNA, RNA, cell line and cell type mentions (from the GENIA corpus); CoNLL version in
    # MTL-Bioinformatics-2016 (data/JNLPBA); GENIA's terms (see bigbio/jnlpba).
    dict(name="jnlpba", task="ner", data=f"{DATA}/jnlpba"),
    # NCBI-disease: disease mentions in PubMed abstracts (Dogan et al. 2014), CC0; CoNLL version in
    # MTL-Bioinformatics-2016 (data/NCBI-disease-IOB).
    dict(name="ncbi_disease", task="ner", data=f"{DATA}/ncbi_disease"),
    # GAD: does a sentence state a gene-disease association (@GENE$ / @DISEASE$ markers)? BLURB's split,
    # CC BY 4.0 (e.g. as vendored in github.com/hieunguyen7337/KeBioLM, data/GAD).
    dict(name="gad", task="cls", data=f"{DATA}/gad"),
    # HoC: the hallmarks of cancer an abstract's sentences discuss, 10 labels, several per example (Baker et
    # al. 2016); BLURB's split, github.com/sb895/Hallmarks-of-Cancer, GPL-3.0; also bigbio/hallmarks_of_cancer.
    dict(name="hoc", task="multilabel", data=f"{DATA}/hoc"),
]
