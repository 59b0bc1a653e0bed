#!/usr/bin/env bash
# A one-host Slurm cluster on this machine (Debian's slurm-wlm + munge, as root), for the tests
# that submit scripts/slurm_train.sbatch for real (tests/e2e/test_slurm.py).
#
#   sudo bash scripts/slurm_local.sh start [DIR]   # munged, slurmctld, slurmd; waits until the node is idle
#   export SLURM_CONF=DIR/slurm.conf               # then sbatch, squeue, sacct -c ... talk to it
#   sudo bash scripts/slurm_local.sh stop [DIR]    # stops the three daemons; nothing is left running
#
# DIR (default /tmp/moe-rl-slurm) holds slurm.conf, the daemons' state, logs and pid files, and
# jobcomp.txt: no slurmdbd, so job accounting is the job-completion file (`sacct -c` reads it).
# SLURM_CPUS (default 2) CPUs on the one node; SLURM_PORT (default 6817) and the next one for slurmd.
set -euo pipefail
CMD=${1:?usage: slurm_local.sh start|stop [DIR]}
D=$(realpath -m "${2:-/tmp/moe-rl-slurm}")
HOST=$(hostname -s)
PORT=${SLURM_PORT:-6817}
export SLURM_CONF=$D/slurm.conf

stop_pidfile() {  # SIGTERM the daemon named in $1, then wait up to 10 s for it to be gone
  local f=$1 pid
  [[ -f $f ]] || return 0
  pid=$(cat "$f")
  kill -TERM "$pid" 2>/dev/null || { rm -f "$f"; return 0; }
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || { rm -f "$f"; return 0; }; sleep 0.1; done
  echo "error: pid $pid ($f) outlived SIGTERM for 10 s; killing it" >&2
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$f"
}

case $CMD in
start)
  command -v slurmctld >/dev/null && command -v munged >/dev/null || {
    echo "error: slurm-wlm and munge are not installed: apt-get install -y slurm-wlm munge" >&2; exit 2; }
  [[ $(id -u) == 0 ]] || { echo "error: the daemons run as root here: sudo bash $0 start" >&2; exit 2; }
  [[ -f $D/slurmctld.pid ]] && { echo "error: $D/slurmctld.pid exists: bash $0 stop $D first" >&2; exit 2; }
  mkdir -p "$D/state" "$D/spool" "$D/munge" /run/munge
  [[ -s /etc/munge/munge.key ]] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; chmod 400 /etc/munge/munge.key; }
  CPUS=${SLURM_CPUS:-2}
  cat >"$SLURM_CONF" <<CONF
ClusterName=moerl
SlurmctldHost=$HOST
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$D/jobcomp.txt
KillWait=30
NodeName=$HOST CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
  munged --force --socket=/run/munge/munge.socket.2 --pid-file="$D/munge/munged.pid" \
    --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
  slurmctld -i
  slurmd
  for _ in $(seq 300); do
    [[ $(sinfo -h -N -o %t 2>/dev/null) == idle ]] && { echo "slurm: $HOST idle, SLURM_CONF=$SLURM_CONF"; exit 0; }
    sleep 0.1
  done
  echo "error: the node is not idle 30 s after start (sinfo: $(sinfo -h -N -o %t 2>&1)); see $D/*.log" >&2
  exit 1
  ;;
stop)
  if [[ -f $D/slurmctld.pid ]] && jobs=$(squeue -h -o %i 2>/dev/null) && [[ -n $jobs ]]; then
    scancel $jobs  # a job's processes must not outlive the cluster
    for _ in $(seq 100); do [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break; sleep 0.1; done
  fi
  stop_pidfile "$D/slurmd.pid"
  stop_pidfile "$D/slurmctld.pid"
  stop_pidfile "$D/munge/munged.pid"
  ;;
*) echo "error: slurm_local.sh: unknown command $CMD (start or stop)" >&2; exit 2 ;;
esac
