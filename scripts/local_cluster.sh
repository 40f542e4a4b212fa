#!/usr/bin/env bash
# A real Slurm cluster of N nodes on this one machine, for tests and local trials (Debian's
# slurmctld, slurmd, slurm-client and munge; run as root). Each node is a network namespace
# with its own hostname (nodeI), its own address (10.77.0.1I) on a private bridge this
# script makes, its own slurmd and spool, and a hosts file naming every node; slurmctld runs
# here, at the bridge's address. Files are shared (one filesystem), as on a cluster with a
# shared home. Nothing outside the namespaces it made is contacted.
#   scripts/local_cluster.sh up STATE_DIR [NODES]   (default 2) -> STATE_DIR/slurm.conf
#   scripts/local_cluster.sh down STATE_DIR         stops what `up` started, removes the
#                                                   namespaces and the bridge
#   scripts/local_cluster.sh cut STATE_DIR I        takes node I's network down (a node
#                                                   lost from the cluster)
#   scripts/local_cluster.sh die STATE_DIR I        node I lost with everything on it: its
#                                                   network down, its processes (its
#                                                   slurmd, a job's tasks) killed
#   scripts/local_cluster.sh mend STATE_DIR I       brings it back as after a reboot:
#                                                   what ran on it is gone, a fresh slurmd
# Then, here: sbatch / squeue / scontrol (SLURM_CONF=STATE_DIR/slurm.conf, also linked
# from /etc/slurm/slurm.conf); `megarlhf launch STAGE CONFIG --slurm launch.nodes=2 ...`.
set -euo pipefail
cmd="${1:-}"; state="$(realpath -m "${2:-}")"
BRIDGE=mrlbr0
NET=10.77.0
usage() { echo "usage: $0 up STATE_DIR [NODES] | down STATE_DIR | cut|die|mend STATE_DIR NODE" >&2; exit 2; }
[ -n "${2:-}" ] || usage

down() {
    if [ -f "$state/pids" ]; then
        while read -r pid; do kill "$pid" 2>/dev/null || true; done < "$state/pids"
        sleep 1
        while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done < "$state/pids"
        rm -f "$state/pids"
    fi
    for ns in $(ip netns list 2>/dev/null | awk '/^mrl-node/ {print $1}'); do
        # whatever still runs on the node (a job's tasks) goes with it
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

case "$cmd" in
    down) down; exit 0 ;;
    cut)
        ip netns exec "mrl-node${3:?node number}" ip link set eth0 down
        exit 0 ;;
    die)
        ip netns exec "mrl-node${3:?node number}" ip link set eth0 down
        for pid in $(ip netns pids "mrl-node$3"); do kill -9 "$pid" 2>/dev/null || true; done
        exit 0 ;;
    mend) ;;
    up) ;;
    *) usage ;;
esac
export SLURM_CONF="$state/slurm.conf"

start_node() {  # slurmd of node $1, in its namespaces
    local i="$1"
    rm -f "$state/slurmd.node$i.pid"
    # its own hostname and hosts file (a private mount), inside its network namespace;
    # slurmd daemonizes and stays there, and so does every task it starts
    # (nsenter, not `ip netns exec`, which remounts /sys and hides the cgroup slurmd reads)
    nsenter --net="/run/netns/mrl-node$i" unshare --uts --mount --propagation private sh -c \
        "hostname node$i && mount --bind '$state/hosts' /etc/hosts && exec /usr/sbin/slurmd -f '$SLURM_CONF' -N node$i"
    for _ in $(seq 1 50); do [ -s "$state/slurmd.node$i.pid" ] && break; sleep 0.2; done
    cat "$state/slurmd.node$i.pid" >> "$state/pids"
}

if [ "$cmd" = mend ]; then
    node="${3:?node number}"
    # a rebooted node: the old job's steps and tasks (cut off, never told to stop) are
    # gone, so they cannot kill the requeued job's tasks when the network returns
    for pid in $(ip netns pids "mrl-node$node"); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns exec "mrl-node$node" ip link set eth0 up
    start_node "$node"
    # back in service now, not at slurmctld's next ping (up to minutes)
    scontrol update NodeName="node$node" State=RESUME 2>/dev/null || true
    exit 0
fi
nodes="${3:-2}"
[ "$(id -u)" = 0 ] || { echo "$0 needs root (network namespaces, slurmd)" >&2; exit 2; }
for bin in slurmctld slurmd munged sbatch ip unshare nsenter; do
    command -v "$bin" >/dev/null || { echo "$bin not found: apt-get install slurmctld slurmd slurm-client munge iproute2" >&2; exit 2; }
done
if pgrep -x slurmctld >/dev/null || pgrep -x slurmd >/dev/null; then
    echo "a slurmctld/slurmd is already running here; stop it first" >&2; exit 2
fi
if ip link show "$BRIDGE" >/dev/null 2>&1; then
    echo "the bridge $BRIDGE exists: another local cluster is up ($0 down STATE_DIR)" >&2; exit 2
fi
trap 'echo "local cluster: start failed; see $state/log" >&2; down' ERR
mkdir -p "$state"/{ctld,log}
ctl="$(hostname -s)"

# the network: a bridge here, one namespace per node with a veth into it
ip link add "$BRIDGE" type bridge
ip addr add "$NET.1/24" dev "$BRIDGE"
ip link set "$BRIDGE" up
{ echo "127.0.0.1 localhost"; echo "$NET.1 $ctl"; } > "$state/hosts"
for i in $(seq 1 "$nodes"); do
    ns="mrl-node$i"
    ip netns add "$ns"
    ip link add "mrlv$i" type veth peer name eth0 netns "$ns"
    ip link set "mrlv$i" master "$BRIDGE" up
    ip netns exec "$ns" ip addr add "$NET.$((10 + i))/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    ip netns exec "$ns" ip link set lo up
    echo "$NET.$((10 + i)) node$i" >> "$state/hosts"
done

# munge: a key, and munged as the munge user (its socket is a file: every node reaches it)
mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
if ! pgrep -x munged >/dev/null; then
    su -s /bin/sh munge -c "/usr/sbin/munged"
    for _ in $(seq 1 25); do [ -s /run/munge/munged.pid ] && break; sleep 0.2; done
    cat /run/munge/munged.pid >> "$state/pids"
fi

cpus="$(getconf _NPROCESSORS_ONLN)"
cat > "$state/slurm.conf" <<CONF
ClusterName=megarlhf-local
SlurmctldHost=$ctl($NET.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
StateSaveLocation=$state/ctld
SlurmdSpoolDir=$state/spool/%n
SlurmctldPidFile=$state/slurmctld.pid
SlurmdPidFile=$state/slurmd.%n.pid
SlurmctldLogFile=$state/log/slurmctld.log
SlurmdLogFile=$state/log/slurmd.%n.log
ReturnToService=2
JobRequeue=1
# A node that stops answering is marked down after 20 s (Slurm's default: 300 s).
SlurmdTimeout=20
# A requeued job waits until its old credential expires (Slurm's default: 120 s); started
# earlier on the same node it is killed ("Job credential revoked").
AuthInfo=cred_expire=10
MpiDefault=none
CONF
for i in $(seq 1 "$nodes"); do
    echo "NodeName=node$i NodeAddr=$NET.$((10 + i)) NodeHostname=node$i CPUs=$cpus State=UNKNOWN" >> "$state/slurm.conf"
    mkdir -p "$state/spool/node$i"
done
echo "PartitionName=debug Nodes=node[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >> "$state/slurm.conf"
mkdir -p /etc/slurm && ln -sf "$state/slurm.conf" /etc/slurm/slurm.conf

/usr/sbin/slurmctld -f "$SLURM_CONF"
for _ in $(seq 1 50); do [ -f "$state/slurmctld.pid" ] && break; sleep 0.2; done
cat "$state/slurmctld.pid" >> "$state/pids"
for i in $(seq 1 "$nodes"); do
    start_node "$i"
done
for _ in $(seq 1 100); do
    if [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE 'idle|mixed')" = "$nodes" ]; then
        echo "local cluster up: $nodes node(s) ($(sinfo -h -N -o '%N=%T' | tr '\n' ' ')), state in $state"
        exit 0
    fi
    sleep 0.2
done
echo "local cluster: the nodes did not come up: $(sinfo -h -N -o '%N=%T %E' | tr '\n' ' '); see $state/log" >&2
down
exit 1
