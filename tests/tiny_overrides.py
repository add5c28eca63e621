"""The smallest run of ``examples/tiny_cpu.yaml`` that still goes through every phase: one
list of overrides for every test that starts a real training run (in-process, torchrun, Slurm
or NeMo-Run). Tests append what they need (step counts, SFT, checkpoints); later overrides
win."""

TINY_RUN = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "rollout.group_size=4",
    "rollout.prompts_per_step=4",
    "rollout.max_new_tokens=8",
    "parallel.micro_batch_size=4",
    "data.countdown.n_train=64",
    "data.countdown.n_eval=8",
    "trainer.progress=false",
    "trainer.loggers=[]",
]
