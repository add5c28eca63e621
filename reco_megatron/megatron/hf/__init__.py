"""Hugging Face weights for Megatron models: configs, the tensor mapping, checkpoints on disk,
and Megatron-Bridge as an optional converter.

* :mod:`.config`: HF ``config.json`` <-> :class:`~reco_megatron.megatron.model.config.ModelConfig`;
* :mod:`.convert`: HF names and layouts <-> Megatron parameters, TP sharding;
* :mod:`.checkpoint`: streamed safetensors export, checked import, the policy weight stream;
* :mod:`.bridge`: NVIDIA Megatron-Bridge's ``AutoBridge`` behind the same calls;
* :mod:`.converter`: which of the two maps the weights for a run (``checkpoint.hf_converter``).

This room never imports the training engine (engine, loss layers, optimizer, checkpoints).
"""
