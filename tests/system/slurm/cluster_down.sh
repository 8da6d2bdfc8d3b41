#!/usr/bin/env bash
# cluster_down.sh - tears down what cluster_up.sh built, whatever state it is in (half up,
# daemons dead, jobs running, run twice): cancels jobs, stops the daemons it started (by the
# pids in their pid files, checked against the executable), kills by pid whatever still lives
# in its network namespaces (slurmstepd, job tasks), deletes the namespaces, veths and bridge,
# its /etc/hosts lines, and the state directory. Logs are kept in $STATE/log unless
# FSDP_SLURM_KEEP_LOGS=0. Never touches processes, namespaces or files of anybody else.
# Exit status 0 unless something of ours could not be removed.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/cluster_env.sh"
KEEP_LOGS=${FSDP_SLURM_KEEP_LOGS:-1}
[ "$(id -u)" = 0 ] || { echo "cluster_down.sh: must run as root" >&2; exit 1; }
export SLURM_CONF=$CONF
status=0

alive() { kill -0 "$1" 2>/dev/null; }
# ours PIDFILE: prints the pid if it names a live slurm/munge daemon (not a reused pid).
ours() {
  [ -s "$1" ] || return 1
  local pid
  pid=$(cat "$1")
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  case "$(readlink "/proc/$pid/exe" 2>/dev/null)" in
    # Debian installs the daemons as slurmd-wlm / slurmctld-wlm behind alternatives.
    */slurmd|*/slurmd-wlm|*/slurmctld|*/slurmctld-wlm|*/munged) echo "$pid" ;;
    *) return 1 ;;
  esac
}
# wait_gone SECONDS PID...: returns once every PID has exited or SECONDS have passed.
wait_gone() {
  local deadline=$((SECONDS + $1)) p
  shift
  for p in "$@"; do
    alive "$p" || continue
    # tail --pid returns when the process exits (it checks every 0.1 s).
    timeout "$((deadline > SECONDS ? deadline - SECONDS : 1))" \
      tail -s 0.1 --pid="$p" -f /dev/null 2>/dev/null
  done
}
# stop PID...: SIGTERM, up to 10 s, then SIGKILL.
stop() {
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  wait_gone 10 "$@"
  local p left=()
  for p in "$@"; do alive "$p" && left+=("$p"); done
  [ ${#left[@]} -eq 0 ] && return 0
  log "SIGKILL to ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null
  wait_gone 2 "${left[@]}"
}
namespaces() { ls /run/netns 2>/dev/null | grep "^$NS_PREFIX" || true; }

# 1. Jobs, while the controller is up: lets slurmstepd end them the normal way.
if ctld=$(ours "$STATE/run/slurmctld.pid") && [ -e "$CONF" ]; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// }" ]; then
    log "cancelling jobs $jobs"
    timeout 10 scancel $jobs 2>/dev/null
  fi
fi

# 2. Daemons (SIGTERM to all at once: each takes ~2 s to exit).
pids=()
for pf in "$STATE"/run/slurmd-*.pid "$STATE/run/slurmctld.pid" "$STATE/run/munged.pid"; do
  pid=$(ours "$pf") && pids+=("$pid")
done
if [ ${#pids[@]} -gt 0 ]; then
  log "stopping daemons ${pids[*]}"
  stop "${pids[@]}"
fi

# 3. Whatever still runs in our namespaces: left-over slurmstepd or job tasks.
left=()
for ns in $(namespaces); do
  pids_in_ns=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
  [ -n "${pids_in_ns// }" ] || continue
  log "processes left in $ns: $pids_in_ns"
  left+=($pids_in_ns)
done
stop "${left[@]}"

# 4. Network.
for ns in $(namespaces); do ip netns del "$ns" || status=1; done
for veth in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' |
              grep '^fsdpsv[0-9c]*$'); do
  ip link del "$veth" 2>/dev/null
done
if ip link show "$BR" >/dev/null 2>&1; then ip link del "$BR" || status=1; fi

# 5. /etc/hosts lines (rewritten in place: it may be a bind mount).
if grep -q "$HOSTS_TAG\$" /etc/hosts; then
  grep -v "$HOSTS_TAG\$" /etc/hosts > /etc/hosts.fsdp-slurm-test.tmp
  cat /etc/hosts.fsdp-slurm-test.tmp > /etc/hosts
  rm -f /etc/hosts.fsdp-slurm-test.tmp
fi

# 6. State.
rm -rf "$STATE/run" "$STATE/ctld-state" "$STATE/spool" "$CONF_DIR"
[ "$KEEP_LOGS" = 1 ] || rm -rf "$STATE"
log "down"
exit $status
