"""Test-only (put this folder on PYTHONPATH): the spawned rollout worker named by
``RECO_TEST_HANG_WORKER=<worker id>:<call>`` hangs in its ``<call>``-th generation, the way a
stuck engine does: its heartbeat thread keeps running, its generation never returns. Every
other process (the trainer, other workers) is left as it is."""

import os

_spec = os.environ.get("RECO_TEST_HANG_WORKER", "")
if _spec and os.environ.get("RECO_ROLLOUT_WORKER") == _spec.split(":")[0]:
    import threading

    from reco_megatron.rollout import embedded

    _generate = embedded.EmbeddedEngine.generate
    _calls = [0]

    def _hanging_generate(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] >= int(_spec.split(":")[1]):
            threading.Event().wait()  # never set
        return _generate(self, *args, **kwargs)

    embedded.EmbeddedEngine.generate = _hanging_generate
