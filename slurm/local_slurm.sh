#!/usr/bin/env bash
# A real single-node Slurm for tests and local trials (Debian packages slurmctld, slurmd,
# slurm-client, munge; run as root).
#   slurm/local_slurm.sh start STATE_DIR   -> writes STATE_DIR/pids and STATE_DIR/slurm.conf
#   slurm/local_slurm.sh stop STATE_DIR    -> stops exactly the daemons it started
set -euo pipefail
cmd="$1"; state="$(realpath -m "$2")"
if [ "$cmd" = "stop" ]; then
    [ -f "$state/pids" ] || exit 0
    while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$state/pids"
    sleep 1
    while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$state/pids"
    rm -f "$state/pids"
    exit 0
fi
[ "$cmd" = "start" ] || { echo "usage: $0 start|stop STATE_DIR" >&2; exit 2; }
for bin in slurmctld slurmd munged sbatch; do
    command -v "$bin" >/dev/null || { echo "$bin not found: apt-get install slurmctld slurmd slurm-client munge" >&2; exit 2; }
done
if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; then
    echo "a slurmctld/slurmd is already running here; stop it first" >&2; exit 2
fi
mkdir -p "$state"/{spool,ctld,log}
host="$(hostname -s)"
# munge: a key, and munged as the munge user
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c "/usr/sbin/munged"
    for _ in $(seq 1 25); do [ -s /run/munge/munged.pid ] && break; sleep 0.2; done
    cat /run/munge/munged.pid >> "$state/pids"
fi
cat > "$state/slurm.conf" <<CONF
ClusterName=megarlhf-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.log
ReturnToService=2
JobRequeue=1
# A requeued job waits until its old credential expires (Slurm's default: 120 s); started
# earlier on the same node it is killed ("Job credential revoked").
AuthInfo=cred_expire=10
MpiDefault=none
NodeName=$host CPUs=$(getconf _NPROCESSORS_ONLN) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$state/slurm.conf"
mkdir -p /etc/slurm && ln -sf "$state/slurm.conf" /etc/slurm/slurm.conf
/usr/sbin/slurmctld -f "$SLURM_CONF"
/usr/sbin/slurmd -f "$SLURM_CONF"
for _ in $(seq 1 50); do
    [ -f "$state/slurmctld.pid" ] && [ -f "$state/slurmd.pid" ] && break; sleep 0.2
done
cat "$state/slurmctld.pid" "$state/slurmd.pid" >> "$state/pids"
for _ in $(seq 1 50); do
    sinfo -h -o %T 2>/dev/null | grep -qE "idle|mixed" && { echo "slurm up: $(sinfo -h)"; exit 0; }
    sleep 0.2
done
echo "slurm did not come up; see $state/log" >&2
exit 1
