#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/workflow/test_slurm.py and the SLURM step of .ci/run.
#
#   sudo .ci/slurm/start.sh      # installs slurm-wlm + munge if missing, starts munged, slurmctld, slurmd
#   sudo .ci/slurm/stop.sh       # stops them and removes what start.sh wrote
#
# Two partitions on the one node: `cpu` (the default) and `gpu`. The node has no GPU; the `gpu`
# partition only lets the test see that GPU rules are routed by SLURM_GPU_PARTITION.
# No accounting database (accounting_storage/none), so `sacct` does not work: clients query job
# states with squeue, which keeps finished jobs for MinJobAge seconds.
#
# Root is needed: apt-get, /etc/slurm/slurm.conf, and slurmd runs jobs as their submitting user.
# The config must sit at /etc/slurm/slurm.conf, the path compiled into the SLURM tools: the plugin's
# job step strips SLURM_* variables (SLURM_CONF among them) before it calls srun inside a job.
# Everything else (state, spool, logs, pid files) goes to $VLBERT_SLURM_DIR (default /tmp/vlbert-slurm).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STATE_DIR=${VLBERT_SLURM_DIR:-/tmp/vlbert-slurm}
SLURM_CONF_PATH=/etc/slurm/slurm.conf
MUNGE_KEY=/etc/munge/munge.key
# stop.sh removes /etc/slurm/slurm.conf only when it carries this line.
MARKER="# Written by vlbert .ci/slurm/start.sh; removed by .ci/slurm/stop.sh."
READY_TIMEOUT_S=${VLBERT_SLURM_READY_TIMEOUT_S:-60}

die() {
    echo "slurm/start.sh: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages, writes $SLURM_CONF_PATH and starts slurmd)"

# 1. Packages. Debian/Ubuntu's slurm-wlm pulls slurmctld, slurmd and the client tools.
missing=()
for tool in slurmctld slurmd sbatch squeue sinfo scontrol munged munge unmunge; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null 2>&1 || die "missing ${missing[*]} and no apt-get to install slurm-wlm and munge"
    echo "slurm/start.sh: installing slurm-wlm and munge (missing: ${missing[*]})"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi
command -v mungekey >/dev/null 2>&1 || [ -e "$MUNGE_KEY" ] || die "no $MUNGE_KEY and no mungekey to create one"

# 2. Leftovers of an earlier run (a killed test) go first, so the daemons start on a clean state.
"$HERE/stop.sh"

if [ -e "$SLURM_CONF_PATH" ] && ! grep -qxF "$MARKER" "$SLURM_CONF_PATH"; then
    die "$SLURM_CONF_PATH exists and was not written by this script; not overwriting a real cluster's config"
fi

mkdir -p "$STATE_DIR"/{ctld,spool,munge}
chmod 0755 "$STATE_DIR"

# 3. munge: every SLURM message is signed with the shared key. munged runs as user munge, like
# Debian's service, and refuses a key, log or pid directory that other users can write.
if [ ! -e "$MUNGE_KEY" ]; then
    runuser -u munge -- mungekey --create --keyfile="$MUNGE_KEY"
fi
chown munge:munge "$STATE_DIR/munge"
chmod 0700 "$STATE_DIR/munge"
install -d -o munge -g munge -m 0755 /run/munge
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    # A munged of the machine (the distribution's service) already answers: use it, leave it running.
    echo "slurm/start.sh: using the munged that is already running"
else
    runuser -u munge -- munged \
        --pid-file="$STATE_DIR/munge/munged.pid" \
        --log-file="$STATE_DIR/munge/munged.log" \
        --seed-file="$STATE_DIR/munge/munged.seed"
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.2
    done
    munge -n | unmunge >/dev/null || die "munged does not answer; see $STATE_DIR/munge/munged.log"
fi

# 4. slurm.conf for this host, with the CPUs and memory slurmd itself detects (a node that claims
# more than it has is drained; one that claims less wastes it).
node_line=$(slurmd -C | head -n 1)   # NodeName=<host> CPUs=.. Boards=.. ... RealMemory=..
case "$node_line" in
    NodeName=*" CPUs="*"RealMemory="*) ;;
    *) die "unexpected output of 'slurmd -C': $node_line" ;;
esac
node_name=${node_line%% *}
node_name=${node_name#NodeName=}
mkdir -p "$(dirname "$SLURM_CONF_PATH")"
cat >"$SLURM_CONF_PATH" <<EOF
$MARKER
# A one-node cluster on $node_name for the tests; state in $STATE_DIR.
ClusterName=vlbert-ci
SlurmctldHost=$node_name(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
# No cgroups in CI containers: track job processes by process group, do no CPU binding.
ProctrackType=proctrack/pgid
TaskPlugin=task/none
# CPUs and memory are consumable, so jobs share the node as their requests allow.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# A job without --mem would otherwise get the whole node's memory (the plugin always passes --mem).
DefMemPerCPU=1000
SchedulerType=sched/backfill
# No accounting database; squeue (not sacct) reports job states, for MinJobAge seconds after the end.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=3600
# A node that was down comes back by itself once slurmd registers with valid resources.
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=cpu Nodes=$node_name Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$node_name Default=NO MaxTime=INFINITE State=UP
EOF

# 5. The daemons (no systemd here): each forks into the background and writes its pid file.
# -c: start slurmctld without the job state of an earlier run.
slurmctld -c
slurmd

# 6. Ready when the node is idle; bounded, with the daemons' logs on failure.
state=""
for _ in $(seq $((READY_TIMEOUT_S * 2))); do
    state=$(sinfo --noheader --nodes="$node_name" --format=%T 2>/dev/null | head -n 1 || true)
    [ "$state" = "idle" ] && break
    sleep 0.5
done
if [ "$state" != "idle" ]; then
    echo "slurm/start.sh: node $node_name is '${state:-unreachable}' after ${READY_TIMEOUT_S}s" >&2
    scontrol show node "$node_name" >&2 || true
    tail -n 30 "$STATE_DIR/slurmctld.log" "$STATE_DIR/slurmd.log" >&2 || true
    exit 1
fi
echo "slurm/start.sh: ready: $(sinfo --noheader --format='%P %D %c CPUs %m MB %T' | tr '\n' ';')"
