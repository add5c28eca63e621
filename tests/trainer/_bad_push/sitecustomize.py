"""Test-only (put this folder on PYTHONPATH): the trainer (not its workers) named by
``RECO_TEST_BAD_PUSH=<version>:<how>`` pushes the weights of that version and later ones
wrong, as a trainer of another build or a tampered one would: ``buckets`` sends buckets of
another size than the plan it agreed with the workers (the worker must refuse the push before
it reads a bucket); ``name`` streams a tensor under another name than the plan's (the trainer
must stop before it sends it)."""

import os

_spec = os.environ.get("RECO_TEST_BAD_PUSH", "")
if _spec and "RECO_ROLLOUT_WORKER" not in os.environ:
    import dataclasses

    from reco_megatron.rollout import weight_transport

    _from, _how = _spec.split(":")
    _send_push = weight_transport.send_push

    def _renamed(named):
        for i, (name, tensor) in enumerate(named):
            yield (name + ".renamed" if i == 0 else name), tensor

    def _bad_send_push(targets, plan, sender, version, named, device):
        if version >= int(_from):
            if _how == "buckets":
                plan = dataclasses.replace(plan, bucket_bytes=16)  # one tensor per bucket
            else:
                named = _renamed(named)
        return _send_push(targets, plan, sender, version, named, device)

    weight_transport.send_push = _bad_send_push
