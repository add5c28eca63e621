"""The update step: the engine (:class:`~.engine.ReCoEngine`), its old-policy pass
(``old_policy``), its schedule over micro-batches, packing and data-parallel balance, the loss
layer megatron's ``forward_backward_func`` calls, the batch format and the metric reduction."""
