#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests (crates/tandem-cli/tests/slurm.rs) and CI:
#   sudo scripts/slurm_cluster.sh start    # installs slurmctld, slurmd, munge if missing
#   sudo scripts/slurm_cluster.sh stop
# The node advertises 8 CPUs (config_overrides) so tests can start 4 tasks on a 2-core machine.
# Process tracking without cgroups (proctrack/linuxproc): works in containers.
set -euo pipefail

conf_dir=/etc/slurm
state=/var/spool/slurm-tandem
host="$(hostname -s)"

install() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
}

write_conf() {
  mkdir -p "$conf_dir" "$state/ctld" "$state/d" /var/log/slurm
  cat >"$conf_dir/slurm.conf" <<EOF
ClusterName=tandem
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/d
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
NodeName=$host CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=60 State=UP OverSubscribe=YES
EOF
  # cgroup.conf is read even without cgroup plugins on some builds; keep it harmless.
  printf 'CgroupPlugin=autodetect\n' >"$conf_dir/cgroup.conf"
}

start_munge() {
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  if ! munge -n </dev/null >/dev/null 2>&1; then
    if id munge >/dev/null 2>&1; then
      su -s /bin/sh munge -c munged || munged --force
    else
      munged --force
    fi
  fi
  for _ in $(seq 50); do munge -n </dev/null >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "slurm_cluster: munged did not come up" >&2
  return 1
}

start() {
  install
  # slurmctld and slurmd find this node by its short name.
  getent hosts "$host" >/dev/null || echo "127.0.0.1 $host" >>/etc/hosts
  write_conf
  start_munge
  pgrep -x slurmctld >/dev/null || slurmctld
  pgrep -x slurmd >/dev/null || slurmd
  for _ in $(seq 120); do
    s="$(sinfo -h -n "$host" -o %T 2>/dev/null || true)"
    case "$s" in
      idle*|mix*|alloc*) echo "slurm_cluster: node $host is $s"; return 0 ;;
      down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  echo "slurm_cluster: node $host did not become idle (state: ${s:-none}); logs in /var/log/slurm" >&2
  tail -20 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
  return 1
}

stop() {
  pkill -x slurmd || true
  pkill -x slurmctld || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
