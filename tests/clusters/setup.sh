#!/usr/bin/env bash
# Real launchers and networks for autoddp's tests (tests/clusters/test_clusters_*.py), on one machine:
#
#   * a one-node SLURM cluster (Debian's slurm-wlm and munge): this machine's host name as both
#     controller and node, root as SlurmUser, proctrack/linuxproc, task/none, select/cons_tres;
#   * Open MPI (openmpi-bin) and MPICH (mpich), side by side;
#   * two "hosts": network namespaces autoddp-h0 (10.213.13.1/24) and autoddp-h1 (10.213.13.2/24)
#     joined by a veth pair. The host name is shared and still resolves to 127.0.0.1 (as on many
#     cluster nodes and containers); each namespace's /etc/hosts (/etc/netns/NS/hosts, which
#     `ip netns exec` mounts over /etc/hosts) names the two hosts autoddp-node0 and autoddp-node1,
#     each host naming itself 127.0.1.1 as Debian does.
#
# Usage (as root): tests/clusters/setup.sh [start|stop|status]
#   start   install what is missing, start munged, slurmctld and slurmd, make the namespaces;
#           idempotent (what already runs is kept). Exit status 0 when everything is ready,
#           1 when some part could not be set up (the tests of that part then skip, saying why).
#   stop    stop the daemons this script started and remove the namespaces (and their files).
#   status  say what is ready.
# The daemons run detached (not children of the caller), until `stop`. Files: /etc/slurm/slurm.conf
# (only if absent or written by this script), /var/lib/autoddp-clusters, /run/autoddp-clusters.
set -uo pipefail

STATE=/var/lib/autoddp-clusters
RUN=/run/autoddp-clusters
CONF=/etc/slurm/slurm.conf
MARK="# written by autoddp tests/clusters/setup.sh"
NS=(autoddp-h0 autoddp-h1)
ADDR=(10.213.13.1 10.213.13.2)
PACKAGES=(slurm-wlm munge openmpi-bin mpich iproute2)

say() { echo "clusters: $*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    say "not root: cannot install packages, start SLURM or make network namespaces (the tests skip)"
    exit 1
  fi
}

install_missing() {
  local missing=() pkg
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if ! command -v apt-get >/dev/null; then
    say "apt-get is not available: cannot install ${missing[*]}"
    return 1
  fi
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # apt runs gpgv (and the downloads) as its sandbox user _apt; on some machines of this kind _apt
  # cannot run it, and `apt-get update` refuses Debian's lists as unsigned although gpgv is
  # installed. This script runs as root anyway: apt keeps root for those steps.
  local apt=(apt-get -o APT::Sandbox::User=root)
  timeout 300 "${apt[@]}" update -qq >/dev/null 2>&1 || say "apt-get update failed (installing from the lists present)"
  if ! timeout 600 "${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    # One by one, so that what can be installed is (MPICH beside Open MPI, say).
    for pkg in "${missing[@]}"; do
      timeout 300 "${apt[@]}" install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
        || say "could not install $pkg"
    done
  fi
}

# A daemon in pid file $1 is running (a zombie left to an init that does not reap is not).
alive() {
  local pid
  [ -s "$1" ] && pid="$(cat "$1")" && kill -0 "$pid" 2>/dev/null \
    && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$pid/stat" 2>/dev/null
}

start_munge() {
  command -v munged >/dev/null || { say "munge is not installed"; return 1; }
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge "$RUN"
  [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
  if ! alive /run/munge/munged.pid; then
    runuser -u munge -- munged || { say "munged did not start (see /var/log/munge/munged.log)"; return 1; }
    touch "$RUN/munged.ours"  # `stop` stops only a munged this script started
  fi
  munge -n | unmunge >/dev/null || { say "munge does not work"; return 1; }
}

write_slurm_conf() {
  local host cpus
  host="$(hostname -s)"
  cpus="$(nproc)"
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    say "$CONF exists and was not written by this script: left alone (using it as it is)"
    return 0
  fi
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$RUN"
  cat >"$CONF.new" <<EOF
$MARK
ClusterName=autoddp
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
KillWait=5
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=autoddp Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
  if cmp -s "$CONF.new" "$CONF"; then rm -f "$CONF.new"; else mv "$CONF.new" "$CONF"; fi
}

start_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null || { say "SLURM is not installed"; return 1; }
  write_slurm_conf
  alive "$RUN/slurmctld.pid" || slurmctld || { say "slurmctld did not start (see $STATE/slurmctld.log)"; return 1; }
  alive "$RUN/slurmd.pid" || slurmd || { say "slurmd did not start (see $STATE/slurmd.log)"; return 1; }
  local host i
  host="$(hostname -s)"
  for i in $(seq 60); do
    if sinfo -h -N -n "$host" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
      timeout 60 srun -n 1 true && return 0
    fi
    [ "$i" = 20 ] && scontrol update nodename="$host" state=resume >/dev/null 2>&1
    sleep 0.5
  done
  say "SLURM started but the node is not ready: $(sinfo -h -N -o '%N %t %E' 2>&1)"
  return 1
}

make_hosts() {
  command -v ip >/dev/null || { say "ip (iproute2) is not installed"; return 1; }
  local i
  for i in 0 1; do
    ip netns list | grep -qw "${NS[$i]}" || ip netns add "${NS[$i]}" || { say "cannot make network namespaces"; return 1; }
  done
  if ! ip -n "${NS[0]}" link show autoddp-v0 >/dev/null 2>&1; then
    ip -n "${NS[1]}" link del autoddp-v1 >/dev/null 2>&1
    ip link add autoddp-v0 netns "${NS[0]}" type veth peer name autoddp-v1 netns "${NS[1]}" \
      || { say "cannot make a veth pair"; return 1; }
  fi
  for i in 0 1; do
    ip -n "${NS[$i]}" addr replace "${ADDR[$i]}/24" dev "autoddp-v$i"
    ip -n "${NS[$i]}" link set lo up
    ip -n "${NS[$i]}" link set "autoddp-v$i" up
    mkdir -p "/etc/netns/${NS[$i]}"
    {
      grep -v 'autoddp-node' /etc/hosts
      echo "127.0.1.1 autoddp-node$i"
      echo "${ADDR[$((1 - i))]} autoddp-node$((1 - i))"
    } >"/etc/netns/${NS[$i]}/hosts"
  done
}

status() {
  local ok=0
  if command -v srun >/dev/null && timeout 10 sinfo -h >/dev/null 2>&1; then
    say "SLURM $(sinfo -V | cut -d' ' -f2): $(sinfo -h -N -o '%N %t' | head -n 1)"
  else
    say "SLURM: not running"; ok=1
  fi
  command -v mpirun.openmpi >/dev/null && say "Open MPI $(mpirun.openmpi --version | head -n 1 | awk '{print $NF}')" \
    || { say "Open MPI: not installed"; ok=1; }
  command -v mpiexec.mpich >/dev/null && say "MPICH $(mpichversion 2>/dev/null | awk '/Version/ {print $NF}')" \
    || { say "MPICH: not installed"; ok=1; }
  if ip netns list 2>/dev/null | grep -qw "${NS[1]}"; then
    say "two hosts: ${NS[0]} ${ADDR[0]}, ${NS[1]} ${ADDR[1]}"
  else
    say "two hosts: no namespaces"; ok=1
  fi
  return $ok
}

stop() {
  local pid
  # The jobs of the controller this script started, which stops now; never those of another cluster.
  alive "$RUN/slurmctld.pid" && scancel --state=running -u root >/dev/null 2>&1
  local daemons=("$RUN/slurmd.pid" "$RUN/slurmctld.pid")
  [ -e "$RUN/munged.ours" ] && daemons+=(/run/munge/munged.pid)
  for pid in "${daemons[@]}"; do
    if alive "$pid"; then
      kill "$(cat "$pid" 2>/dev/null)" 2>/dev/null
      for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    fi
    rm -f "$pid"
  done
  rm -f "$RUN/munged.ours"
  for ns in "${NS[@]}"; do
    ip netns del "$ns" 2>/dev/null
    rm -rf "/etc/netns/$ns"
  done
  say "stopped"
}

case "${1:-start}" in
  start)
    need_root
    install_missing
    failed=0
    start_munge && { start_slurm || failed=1; } || failed=1
    make_hosts || failed=1
    status || failed=1
    exit $failed
    ;;
  stop) need_root; stop ;;
  status) status ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac
