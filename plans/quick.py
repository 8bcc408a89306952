# Every step of a plan, tiny: what the tests run. Stacked after a plan, it keeps the plan's design (its arms, seeds,
# tasks and protocol) and shrinks its sizes: a 4-layer model of 64 on the first documents of each corpus.
#   python demo.py plans/quick.py                      # the demo, in about a minute
#   python demo.py plans/h200.py plans/quick.py        # the H200 study on a slice of ../shared/data/study
out = out + "_quick"
docs = 2000 if domain == ["builtin"] else 300  # the built-in task needs its subpackages; a Gutenberg text: 1,500 words
heldout = 200  # as many as the README's cka.py commands draw
val_docs = 20
tokenizer = "bpe:1024"
base_tokens = 20_000
arm_tokens = 10_000
train = train + ["--model_config={'hidden_size': 64, 'intermediate_size': 96, 'num_hidden_layers': 4, "
                 "'num_attention_heads': 2}", "--seq_len=128",
                 "--global_batch_size=4", "--micro_batch_size=4", "--warmup_tokens=1024", "--eval_windows=8",
                 "--eval_interval=10", "--log_interval=2", "--keep_every=4"]
cka_n = 16
cka_len = 128
finetune = {**finetune, "seeds": [42, 43], "epochs": 1, "max_len": 128}
examples = 40
