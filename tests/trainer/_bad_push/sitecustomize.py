"""Test-only (put this folder on PYTHONPATH): the trainer (not its workers) named by
``RECO_TEST_BAD_PUSH=<version>`` sends the weights of that version and later ones in buckets
of another size than the plan it agreed with the workers, as a trainer of another build or a
tampered one would. The worker must refuse the push before it reads a bucket."""

import os

_from = os.environ.get("RECO_TEST_BAD_PUSH", "")
if _from and "RECO_ROLLOUT_WORKER" not in os.environ:
    import dataclasses

    from reco_megatron.rollout import weight_transport

    _send_push = weight_transport.send_push

    def _bad_send_push(targets, plan, sender, version, named, device):
        if version >= int(_from):
            plan = dataclasses.replace(plan, bucket_bytes=16)  # one tensor per bucket
        return _send_push(targets, plan, sender, version, named, device)

    weight_transport.send_push = _bad_send_push
