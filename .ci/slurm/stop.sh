#!/usr/bin/env bash
# Stops the one-node cluster of .ci/slurm/start.sh and removes what it wrote. Safe to run when
# nothing is running. Only the daemons named in start.sh's pid files are signalled, and only jobs
# of this cluster's partitions are cancelled; a munged that start.sh found running is left alone.
set -uo pipefail

STATE_DIR=${VLBERT_SLURM_DIR:-/tmp/vlbert-slurm}
SLURM_CONF_PATH=/etc/slurm/slurm.conf
MARKER="# Written by vlbert .ci/slurm/start.sh; removed by .ci/slurm/stop.sh."

ours_conf() { [ -e "$SLURM_CONF_PATH" ] && grep -qxF "$MARKER" "$SLURM_CONF_PATH"; }

# Jobs first, while slurmctld can still tell slurmd to end them (a stopped slurmd leaves running
# jobs behind). One scancel per partition: slurm 22.05's scancel ignores a comma-separated list.
if ours_conf && command -v scancel >/dev/null 2>&1; then
    for partition in cpu gpu; do
        timeout 10 scancel --partition="$partition" --quiet 2>/dev/null
    done
    for _ in $(seq 40); do
        active=$(timeout 5 squeue --noheader --states=RUNNING,COMPLETING,PENDING 2>/dev/null) || break
        [ -z "$active" ] && break
        sleep 0.5
    done
fi

# Signals the daemon of one pid file, if that pid still runs the expected program; waits for it to exit.
stop_daemon() {
    local pid_file=$1 program=$2 pid
    [ -f "$pid_file" ] || return 0
    pid=$(tr -dc '0-9' <"$pid_file")
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$program" ]; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.2
        done
        if kill -0 "$pid" 2>/dev/null; then
            echo "slurm/stop.sh: $program ($pid) ignored SIGTERM for 10 s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null
        fi
    fi
    rm -f "$pid_file"
}

stop_daemon "$STATE_DIR/slurmd.pid" slurmd
stop_daemon "$STATE_DIR/slurmctld.pid" slurmctld
stop_daemon "$STATE_DIR/munge/munged.pid" munged

if ours_conf; then
    rm -f "$SLURM_CONF_PATH"
fi
# Only what start.sh creates there, so that a mistaken VLBERT_SLURM_DIR cannot wipe anything else.
rm -rf "$STATE_DIR/ctld" "$STATE_DIR/spool" "$STATE_DIR/munge"
rm -f "$STATE_DIR/slurmctld.log" "$STATE_DIR/slurmd.log"
rmdir "$STATE_DIR" 2>/dev/null
exit 0
