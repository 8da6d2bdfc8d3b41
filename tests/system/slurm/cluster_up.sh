#!/usr/bin/env bash
# cluster_up.sh - brings up a real Slurm 22.05 cluster (Debian 12 packages slurmctld, slurmd,
# slurm-client, munge) on this one machine, for the system tests:
#
#   bridge fsdpslurm0      $NET.1/24 on the host (where the test's sbatch/srun/scancel run)
#   netns fsdp-slurm-ctl   $NET.2, hostname fsdp-ctl: slurmctld
#   netns fsdp-slurm-nI    $NET.(10+I), hostname fsdp-nI: slurmd of node fsdp-nI
#
# Each daemon has its own network namespace (own address, own ports) and UTS namespace (own
# hostname); all share the host's file systems, so jobs see the repository and its build/bin
# at the same paths as the test. /etc/hosts gets one tagged line per host so that node names
# resolve everywhere. No default route: nodes reach only the bridge subnet.
#
# Prints the SLURM_CONF clients must use on stdout ("SLURM_CONF=/var/tmp/.../slurm.conf").
# Exit status: 0 up and every node ran `srun true`; 77 cannot run here (not root, packages
# missing, namespaces not permitted) with the reason on stderr; 1 failed (log tails on stderr).
# Leftovers of an earlier run (a test killed before its teardown) are removed first.
# Always pair with cluster_down.sh, e.g. in a trap; see cluster_guard.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/cluster_env.sh"

skip() { echo "cluster_up.sh: cannot run here: $*" >&2; exit 77; }
die() { echo "cluster_up.sh: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || skip "must run as root (network namespaces, daemons)"
missing=()
for tool in slurmctld slurmd srun sbatch scontrol scancel sinfo munged munge unmunge ip nsenter \
            unshare setsid flock; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
[ ${#missing[@]} -eq 0 ] ||
  skip "missing ${missing[*]} (install slurmctld slurmd slurm-client munge: scripts/install-deps)"
[[ "$NNODES" =~ ^[0-9]+$ ]] && [ "$NNODES" -ge 1 ] && [ "$NNODES" -le 20 ] ||
  die "FSDP_SLURM_NODES=$NNODES: expected 1..20"

# A test killed before its teardown leaves daemons, namespaces or hosts lines behind.
if [ -d "$STATE/run" ] || ls /run/netns 2>/dev/null | grep -q "^$NS_PREFIX" ||
   ip link show "$BR" >/dev/null 2>&1; then
  log "leftovers of an earlier cluster: tearing them down first"
  "$HERE/cluster_down.sh"
fi

# ---------------------------------------------------------------- namespaces and bridge
probe=${NS_PREFIX}probe
ip link add fsdpslprobe0 type bridge 2>/dev/null || skip "creating a bridge is not permitted"
ip link del fsdpslprobe0
ip netns add "$probe" 2>/dev/null || skip "creating network namespaces is not permitted"
ip netns del "$probe"
unshare --uts true 2>/dev/null || skip "creating UTS namespaces is not permitted"

mkdir -p "$STATE"/{run,log,ctld-state,spool} "$CONF_DIR"
chmod 755 "$STATE"

ip link add "$BR" type bridge
ip addr add "$HOST_IP/24" dev "$BR"
ip link set "$BR" up
# add_netns NS VETH IP: a namespace on the bridge with address IP on its eth0.
add_netns() {
  local ns=$1 veth=$2 addr=$3
  ip netns add "$ns"
  ip link add "$veth" type veth peer name "${veth}p"
  ip link set "${veth}p" netns "$ns"
  ip -n "$ns" link set "${veth}p" name eth0
  ip link set "$veth" master "$BR"
  ip link set "$veth" up
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
}
add_netns "$CTL_NS" "$CTL_VETH" "$CTL_IP"
for i in $(seq 1 "$NNODES"); do add_netns "$(node_ns "$i")" "$(node_veth "$i")" "$(node_ip "$i")"; done
log "bridge $BR, namespaces $CTL_NS and $NNODES nodes"

# ---------------------------------------------------------------- /etc/hosts
# Rewritten in place: /etc/hosts may be a bind mount (containers).
{
  grep -v "$HOSTS_TAG\$" /etc/hosts || true
  echo "$CTL_IP $CTL_NAME $HOSTS_TAG"
  for i in $(seq 1 "$NNODES"); do echo "$(node_ip "$i") $(node_name "$i") $HOSTS_TAG"; done
} > "$STATE/hosts.new"
cat "$STATE/hosts.new" > /etc/hosts
rm -f "$STATE/hosts.new"

# ---------------------------------------------------------------- munge
MUNGE_SOCK=/run/munge/munge.socket.2
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "using the munged already running (cluster_down.sh leaves it alone)"
else
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  chmod 0755 /run/munge
  chmod 0700 /etc/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --force --keyfile=/etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; fi
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 0400 /etc/munge/munge.key
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  # munged runs as user munge: it must own the files it writes in our root-owned directory.
  touch "$STATE/run/munged.pid" "$STATE/log/munged.log"
  chown munge:munge "$STATE/run/munged.pid" "$STATE/log/munged.log"
  # munged returns once its socket accepts requests.
  runuser -u munge -- /usr/sbin/munged --pid-file="$STATE/run/munged.pid" \
    --log-file="$STATE/log/munged.log"
  munge -n | unmunge >/dev/null || die "munge self-test failed (see $STATE/log/munged.log)"
  log "munged started (pid $(cat "$STATE/run/munged.pid"))"
fi

# ---------------------------------------------------------------- configuration
cat > "$CONF" <<CONF
# generated by cluster_up.sh (fsdp-slurm-test)
ClusterName=fsdptest
SlurmctldHost=$CTL_NAME($CTL_IP)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
# linuxproc finds a job's processes through their parent links: a process that escapes its
# parent (double fork) escapes scancel too, which is what the system test checks for.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Schedule a batch job at once (the default batch_sched_delay=3 adds seconds to each sbatch).
SchedulerParameters=batch_sched_delay=0
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=$STATE/ctld-state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
# sbatch --wait polls every 2 s only while MinJobAge/2 <= 2 (it backs off to 8 s and more
# otherwise); a finished job's record lives at least this long, longer than one poll.
MinJobAge=4
KillWait=5
Waittime=0
TCPTimeout=5
CONF
for i in $(seq 1 "$NNODES"); do
  echo "NodeName=$(node_name "$i") NodeAddr=$(node_ip "$i") NodeHostname=$(node_name "$i")" \
       "CPUs=$NCPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$NCPUS ThreadsPerCore=1" \
       "RealMemory=1024 State=UNKNOWN" >> "$CONF"
done
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >> "$CONF"
chmod 644 "$CONF"
# slurmd 22.05 always initialises a cgroup plugin and reads cgroup.conf next to slurm.conf. On
# cgroup-v1/hybrid hosts autodetection works; on pure cgroup v2 without systemd as PID 1 (CI
# containers) the v2 plugin must not ask systemd for its scope.
if [ "$(stat -fc %T /sys/fs/cgroup 2>/dev/null)" = cgroup2fs ]; then
  if [ -d /run/systemd/system ]; then ignore=IgnoreSystemdOnFailure=yes; else ignore=IgnoreSystemd=yes; fi
  printf '# generated by cluster_up.sh\nCgroupPlugin=cgroup/v2\n%s\nCgroupAutomount=yes\n' \
    "$ignore" > "$CONF_DIR/cgroup.conf"
fi
export SLURM_CONF=$CONF

# ---------------------------------------------------------------- daemons
# in_ns NS HOSTNAME CMD...: CMD in network namespace NS and a new UTS namespace named HOSTNAME.
# nsenter, not `ip netns exec`: the latter remounts /sys privately, which hides
# /sys/fs/cgroup, and slurmd then fails to initialise its cgroup plugin.
in_ns() {
  local ns=$1 name=$2
  shift 2
  nsenter --net="/run/netns/$ns" -- unshare --uts -- \
    sh -c 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"' "$name" "$@"
}
tail_logs() { for f in "$STATE"/log/*.log; do echo "== $f"; tail -15 "$f"; done >&2; }

# -c: no jobs or nodes from an earlier state; -i: ignore missing state files.
in_ns "$CTL_NS" "$CTL_NAME" /usr/sbin/slurmctld -c -i -f "$CONF"
# slurmctld daemonizes before it listens; `scontrol ping` answers once it does.
deadline=$((SECONDS + TIMEOUT))
until scontrol ping >/dev/null 2>&1; do
  [ $SECONDS -lt $deadline ] || { tail_logs; die "slurmctld did not answer within ${TIMEOUT}s"; }
  sleep 0.1
done
log "slurmctld up (pid $(cat "$STATE/run/slurmctld.pid"))"

for i in $(seq 1 "$NNODES"); do
  mkdir -p "$STATE/spool/$(node_name "$i")"
  in_ns "$(node_ns "$i")" "$(node_name "$i")" /usr/sbin/slurmd -N "$(node_name "$i")" -f "$CONF"
done

# A job on every node is scheduled as soon as the last slurmd registered: it is the readiness
# check (no polling of node states) and proves that every node can run a step and talk back.
if ! out=$(timeout "$TIMEOUT" srun --nodes="$NNODES" --job-name=fsdp-cluster-ready \
             --quiet hostname 2>&1); then
  echo "$out" >&2
  sinfo -N >&2 || true
  tail_logs
  die "no job ran on all $NNODES nodes within ${TIMEOUT}s"
fi
log "cluster ready: $(echo "$out" | sort | tr '\n' ' ')"
echo "SLURM_CONF=$CONF"
