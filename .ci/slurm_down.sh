#!/bin/bash
# Stop the daemons .ci/slurm_up.sh started (by their pid files), then munged.
set -uo pipefail
STATE_DIR=${STATE_DIR:-/tmp/reco-slurm}
for name in slurmd slurmctld; do
  pidfile=$STATE_DIR/$name.pid
  if [ -s "$pidfile" ]; then
    kill "$(cat "$pidfile")" 2>/dev/null || true
  fi
done
if [ "${STOP_MUNGE:-1}" = 1 ] && [ -s /run/munge/munged.pid ]; then
  kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
fi
echo "slurm_down: stopped"
