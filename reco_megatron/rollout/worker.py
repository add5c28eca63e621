"""The rollout worker program moved to :mod:`reco_megatron.rollout_worker` (it runs
multi-turn episodes, and ``envs`` sits above ``rollout``); this entry only says so."""

from __future__ import annotations

import sys

NEW_ENTRY = "python -m reco_megatron.rollout_worker"


def main() -> int:
    sys.stderr.write(  # one line and exit 2, as the package's other commands refuse
        f"reco_megatron.rollout.worker has moved: start the rollout worker with {NEW_ENTRY} "
        "(same arguments)\n"
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
