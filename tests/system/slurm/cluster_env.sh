# Names, addresses and paths of the test Slurm cluster; sourced by cluster_up.sh,
# cluster_down.sh and cluster_guard.sh so that they always agree.
#
# Everything has names of its own (bridge fsdpslurm0, namespaces fsdp-slurm-*, hosts fsdp-*,
# /etc/hosts lines tagged "# fsdp-slurm-test", state under FSDP_SLURM_DIR) so that it neither
# sees nor disturbs another Slurm on the machine. slurmctld and every slurmd live in network
# namespaces of their own, so their fixed ports (6817, 6818) cannot clash with anything on the
# host. The Slurm configuration lives in $STATE/etc (clients need SLURM_CONF=$CONF), never in
# /etc/slurm.
#
# Knobs (environment):
#   FSDP_SLURM_NODES   number of compute nodes, 1..20 (default 2)
#   FSDP_SLURM_CPUS    CPUs each node advertises (default 4; may exceed the real count:
#                      SlurmdParameters=config_overrides lets the nodes oversubscribe)
#   FSDP_SLURM_DIR     state, configuration and logs (default /var/tmp/fsdp-slurm-test)
#   FSDP_SLURM_SUBNET  first three octets of the bridge's /24 (default 10.233.0)
#   FSDP_SLURM_TIMEOUT seconds to wait for the daemons and the nodes (default 60)

NNODES=${FSDP_SLURM_NODES:-2}
NCPUS=${FSDP_SLURM_CPUS:-4}
STATE=${FSDP_SLURM_DIR:-/var/tmp/fsdp-slurm-test}
NET=${FSDP_SLURM_SUBNET:-10.233.0}
TIMEOUT=${FSDP_SLURM_TIMEOUT:-60}

BR=fsdpslurm0
NS_PREFIX=fsdp-slurm-
HOSTS_TAG="# fsdp-slurm-test"
CONF_DIR=$STATE/etc
CONF=$CONF_DIR/slurm.conf
LOCK_FILE=/run/lock/fsdp-slurm-test.lock

HOST_IP=$NET.1          # the host's side of the bridge: where sbatch/srun of the test talk from
CTL_NAME=fsdp-ctl
CTL_IP=$NET.2
CTL_NS=${NS_PREFIX}ctl
CTL_VETH=fsdpsvc

node_name() { echo "fsdp-n$1"; }
node_ns()   { echo "${NS_PREFIX}n$1"; }
node_ip()   { echo "$NET.$((10 + $1))"; }
node_veth() { echo "fsdpsv$1"; }

# Seconds since the script started, for the log lines.
T0=$(date +%s.%N)
log() {
  printf '[%s %6.2fs] %s\n' "${0##*/}" \
    "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" "$*" >&2
}
