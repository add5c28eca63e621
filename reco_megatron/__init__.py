"""reco-megatron: ReCo RL post-training of LLMs on megatron-core.

Layers, imported in one direction only:
``algo`` (pure tensor math) <- ``parallel`` (vocabulary-parallel ops, explicit ``tp_group``)
<- ``megatron`` (the only code that touches megatron-core) <- rollout / rewards / trainer
<- CLI and launchers.
"""

__version__ = "0.1.0"
