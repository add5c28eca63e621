#!/bin/bash
# A one-node Slurm cluster on this machine, for tests/launch/test_slurm_cluster.py and CI.
# Needs root; installs Debian's slurm-wlm and munge when absent, writes slurm.conf for this
# host (its real CPU count and memory from `slurmd -C`), starts munged, slurmctld, slurmd.
# Idempotent: a running cluster is left alone. Stop it with .ci/slurm_down.sh.
#   STATE_DIR  where slurm.conf, logs and pid files go (default /tmp/reco-slurm)
set -euo pipefail
STATE_DIR=${STATE_DIR:-/tmp/reco-slurm}

[ "$(id -u)" = 0 ] || { echo "slurm_up: needs root (munged/slurmd run as root)" >&2; exit 77; }
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq slurm-wlm munge >/dev/null; } \
    || { echo "slurm_up: apt-get install slurm-wlm munge failed" >&2; exit 77; }
fi
if scontrol ping 2>/dev/null | grep -q UP && sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc'; then
  echo "slurm_up: a controller is already up"; exit 0
fi

mkdir -p "$STATE_DIR"/{spool,ctld,log} /etc/slurm /run/munge /var/lib/munge /var/log/munge
host=$(hostname -s)
# "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 ... RealMemory=23000"
node_line=$(slurmd -C | head -n 1)
cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$node_line")
mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=reco-ci
SlurmctldHost=$host
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
KillWait=10
NodeName=$host CPUs=$cpus RealMemory=$((mem * 9 / 10)) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- munged 2>/dev/null || munged --force
slurmctld
slurmd
for _ in $(seq 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mix)'; then
    echo "slurm_up: cluster up on $host ($cpus CPUs, ${mem} MB)"; exit 0
  fi
  sleep 0.5
done
echo "slurm_up: the node did not become idle; logs in $STATE_DIR/log" >&2
sinfo >&2 || true
exit 1
