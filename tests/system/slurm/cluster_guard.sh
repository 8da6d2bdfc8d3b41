#!/usr/bin/env bash
# cluster_guard.sh - makes sure the test cluster comes down even when the test that brought it
# up dies without tearing it down (crash, SIGKILL from a ctest timeout).
#
# Started by the test before cluster_up.sh, detached (setsid -f, so that killing the test's
# process tree spares it), with stdin and stdout on pipes whose other ends only the test holds:
#   1. takes the machine-wide lock $LOCK_FILE (one test cluster at a time: two build trees
#      testing at once wait for each other), waiting at most FSDP_SLURM_LOCK_WAIT seconds
#      (default 900), and prints "locked" (or "busy" and exits 1);
#   2. reads stdin until the test writes "disarm" (it tore the cluster down itself) or the
#      pipe closes (the test died): then it runs cluster_down.sh;
#   3. exits, which releases the lock.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/cluster_env.sh"
mkdir -p "$(dirname "$LOCK_FILE")"
exec 9>"$LOCK_FILE"
if ! flock -w "${FSDP_SLURM_LOCK_WAIT:-900}" 9; then
  echo busy
  exit 1
fi
echo locked
# From here on the test no longer reads our output.
mkdir -p "$STATE/log"
exec >>"$STATE/log/guard.log" 2>&1
log "guarding the test cluster"
while IFS= read -r line; do
  [ "$line" = disarm ] && { log "disarmed"; exit 0; }
done
log "the test went away without tearing the cluster down: cluster_down.sh"
"$HERE/cluster_down.sh" 9>&-
