#!/usr/bin/env bash
# A simulated multi-node cluster on one machine: NODES network namespaces ("node0" ... ) whose one NIC each ("nic0",
# a veth) plugs into a bridge in a "switch" namespace, every link shaped to RATE in both directions (tbf qdisc on
# the node's egress and on the switch's egress towards it). COMMAND runs on node0 with an `mpiexec` that starts
# RANKS_PER_NODE ranks on each node; traffic between nodes crosses the shaped veths (TCP), ranks of one node
# share memory.
#
#   ci/cluster.sh NODES RANKS_PER_NODE RATE -- COMMAND [ARGS...]
#   ci/cluster.sh 2 2 1gbit -- mpiexec -n 4 python -m mpcomm.bench --op allreduce -b 64K -e 64M -f 4 --check
#   ci/cluster.sh --probe        # exit 0 if namespaces can be made here, else say why and exit 1
#
# RATE is a tc rate (e.g. 100mbit, 1gbit) or "unlimited" (no shaping). Exit status: COMMAND's (128+N if a signal
# N ended it); 2 for bad arguments; 1 if the cluster could not be built.
#
# What COMMAND (run on node0, as root inside the namespaces) gets:
#   PATH       starts with a directory holding `mpiexec`: the MPICH wheel's hydra mpiexec ($CLUSTER_MPIEXEC, default
#              .venv/bin/mpiexec) with `-launcher ssh -launcher-exec $MPCOMM_CLUSTER_EXEC -hosts node0,... -ppn R`,
#              or, where $CLUSTER_MPIEXEC is Open MPI's (PRRTE), with `--prtemca plm_ssh_agent $MPCOMM_CLUSTER_EXEC
#              --host node0:R,...` and OMPI_MCA_* / PRTE_MCA_* set for nic0 (see inside());
#              $MPIEXEC names the same wrapper. `mpiexec -n NODES*R ...` fills every node.
#   MPCOMM_CLUSTER_EXEC   `$MPCOMM_CLUSTER_EXEC nodeK CMD...` runs CMD on node K (e.g. `ip link set nic0 down`);
#              hydra calls it as its "ssh" (`-x nodeK proxy-command...`).
#   MPCOMM_CLUSTER_NODES ("node0 node1 ..."), MPCOMM_CLUSTER_RANKS_PER_NODE, MPCOMM_CLUSTER_RATE.
#   UCX_TLS=tcp,self UCX_NET_DEVICES=nic0 (FI_PROVIDER=tcp FI_TCP_IFACE=nic0 for the OFI netmod): without them
#              UCX sees one host and moves inter-node messages through shared memory, never touching the NIC.
#   UCX_RNDV_THRESH=inf (unless set): UCX's rendezvous protocol over TCP serialises the two directions of an
#              exchange; eager messages use the link full duplex, as a real NIC would be used
#              (bench/results/observations.md, "UCX's rendezvous over TCP").
#
# Nodes are named node0..node{N-1} and resolve through a hosts file bind-mounted over /etc/hosts; each has its own
# UTS namespace, so MPI.Get_processor_name() differs per node and COMM_TYPE_SHARED splits one group per node.
#
# Teardown: everything lives in private namespaces (network, mount, UTS, PID) under one init process; when it
# ends, the kernel kills every process of the cluster and frees every namespace, link and mount, leaving no trace
# on the host. It ends when COMMAND ends, and is killed (SIGKILL) when this script is interrupted (SIGTERM, SIGINT,
# SIGHUP, e.g. by `timeout`) or itself killed, even by SIGKILL (the parent-death signal of the launcher chain).
# Needs root, or unprivileged user namespaces (then it maps the caller to root in a user namespace).
set -euo pipefail

RUN=/run/mpcomm-cluster           # inside the private mount namespace only (a private tmpfs on /run)
SUBNET=10.77.0

usage() {
    echo "usage: ci/cluster.sh NODES RANKS_PER_NODE RATE -- COMMAND [ARGS...]  (or --probe; see the top of $0)" >&2
    exit 2
}

die() { echo "cluster.sh: $1" >&2; exit "${2:-1}"; }

# ---------------------------------------------------------------------------------------------------- helpers
rate_bits() {  # tc rate -> bits per second (integer)
    local value unit
    [[ $1 =~ ^([0-9]+(\.[0-9]+)?)([kmgt]?bit)$ ]] || return 1
    value=${BASH_REMATCH[1]} unit=${BASH_REMATCH[3]}
    awk -v v="$value" -v u="$unit" 'BEGIN { m = (u=="kbit") ? 1e3 : (u=="mbit") ? 1e6 : (u=="gbit") ? 1e9 : (u=="tbit") ? 1e12 : 1;
                                            printf "%.0f\n", v * m }'
}

unshare_flags() {  # as root: plain namespaces; otherwise a user namespace that maps us to root
    if [[ $(id -u) -eq 0 ]]; then
        echo "--net --mount --uts --pid --fork --mount-proc --propagation private"
    else
        echo "--user --map-root-user --net --mount --uts --pid --fork --mount-proc --propagation private"
    fi
}

probe() {  # can this machine build the cluster? (prints why not)
    local missing=() tool
    for tool in ip tc unshare nsenter setpriv awk; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [[ ${#missing[@]} -eq 0 ]] || { echo "cluster.sh: missing tools: ${missing[*]}" >&2; return 1; }
    local err
    # shellcheck disable=SC2046
    if ! err=$(unshare $(unshare_flags) sh -c '
            mount -n -t tmpfs none /run && mkdir /run/netns && ip netns add probe && ip link add v0 type veth peer name v1 \
            && ip link add br0 type bridge && ip link set v1 netns probe \
            && tc qdisc add dev v0 root tbf rate 1gbit burst 128kb latency 5ms' 2>&1); then
        echo "cluster.sh: cannot build namespaces/links here (need root or user namespaces, veth, bridge, tbf): $err" >&2
        return 1
    fi
}

# ---------------------------------------------------------------------------------------------------- inside
# Runs as PID 1 of the private namespaces ("the switch"): build, run COMMAND on node0, return its status.
inside() {
    local nodes=$1 rpn=$2 rate=$3 mpiexec=$4; shift 4
    local bits burst k ns hosts names=()
    mount -n -t tmpfs -o mode=755 mpcomm-cluster /run
    ln -s /dev/shm /run/shm
    mkdir -p /run/netns "$RUN/bin" "$RUN/uts"
    mount -n -t tmpfs -o mode=1777 mpcomm-cluster-shm /dev/shm   # MPI's shared-memory files go with the cluster
    hostname switch
    sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
    ip link set lo up
    ip link add br0 type bridge forward_delay 0
    ip link set br0 up
    if [[ $rate != unlimited ]]; then
        bits=$(rate_bits "$rate")
        # max(128 KiB, 1 ms at the rate). Messages up to ~128 KiB then leave at the veth's speed, not the rate,
        # but smaller buckets break the rate where it matters: an exchange of two ranks per node
        # (bench/results/observations.md, "The tbf burst of the simulated links").
        burst=$(( bits / 8 / 1000 > 131072 ? bits / 8 / 1000 : 131072 ))
    fi
    hosts="127.0.0.1 localhost"$'\n'
    for ((k = 0; k < nodes; k++)); do
        ns=node$k
        names+=("$ns")
        ip netns add "$ns"
        ip link add "sw$k" type veth peer name nic0 netns "$ns"
        ip link set "sw$k" master br0 up
        ip netns exec "$ns" sh -c "sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 || true
            ip link set lo up && ip addr add $SUBNET.$((k + 1))/24 dev nic0 && ip link set nic0 up"
        if [[ $rate != unlimited ]]; then
            tc qdisc add dev "sw$k" root tbf rate "$rate" burst "$burst" latency 5ms
            ip netns exec "$ns" tc qdisc add dev nic0 root tbf rate "$rate" burst "$burst" latency 5ms
        fi
        touch "$RUN/uts/$ns"
        unshare --uts="$RUN/uts/$ns" hostname "$ns"
        hosts+="$SUBNET.$((k + 1)) $ns"$'\n'
    done
    printf '%s' "$hosts" > "$RUN/hosts"
    mount -n --bind "$RUN/hosts" /etc/hosts

    # `nsexec [ssh options] nodeK command words...`: hydra's "ssh" (it passes -x), and the way to act on a node.
    cat > "$RUN/bin/nsexec" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do
    case \$1 in
        -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;   # ssh options that take a value
        -*) shift ;;
        *) break ;;
    esac
done
[ \$# -ge 2 ] || { echo "nsexec: usage: nsexec NODE COMMAND..." >&2; exit 2; }
node=\$1; shift
[ -e "$RUN/uts/\$node" ] || { echo "nsexec: no node \$node (have: ${names[*]})" >&2; exit 2; }
exec nsenter --uts="$RUN/uts/\$node" ip netns exec "\$node" sh -c "\$*"
EOF
    local hostlist slots
    if "$mpiexec" --version 2>/dev/null | grep -q "Open MPI"; then
        # PRRTE starts its daemons through nsexec as its "ssh"; R slots a node, filled in order. Its TCP transport
        # and daemons use nic0; ob1 keeps TCP between nodes, shared memory inside one (pml ucx would take UCX_TLS,
        # TCP only, inside a node too). The nodes share the host's cores, which Open MPI cannot see: its ranks
        # yield while they wait, as it makes them do when it knows the cores are oversubscribed (spinning, they
        # took 10-100x as long; bench/results/cluster.md).
        slots=$(printf "%s:$rpn," "${names[@]}")
        cat > "$RUN/bin/mpiexec" <<EOF
#!/bin/sh
exec "$mpiexec" --prtemca plm_ssh_agent "$RUN/bin/nsexec" --host ${slots%,} --map-by slot --bind-to none "\$@"
EOF
        export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,sm,tcp OMPI_MCA_btl_tcp_if_include=nic0
        export PRTE_MCA_oob_tcp_if_include=nic0 OMPI_MCA_mpi_yield_when_idle=1
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # (root inside the namespaces)
    else
        hostlist=$(IFS=,; echo "${names[*]}")
        cat > "$RUN/bin/mpiexec" <<EOF
#!/bin/sh
exec "$mpiexec" -launcher ssh -launcher-exec "$RUN/bin/nsexec" -hosts $hostlist -ppn $rpn "\$@"
EOF
    fi
    chmod +x "$RUN/bin/nsexec" "$RUN/bin/mpiexec"

    export PATH="$RUN/bin:$PATH" MPIEXEC="$RUN/bin/mpiexec" MPCOMM_CLUSTER_EXEC="$RUN/bin/nsexec"
    export MPCOMM_CLUSTER_NODES="${names[*]}" MPCOMM_CLUSTER_RANKS_PER_NODE=$rpn MPCOMM_CLUSTER_RATE=$rate
    export UCX_TLS=tcp,self UCX_NET_DEVICES=nic0 FI_PROVIDER=tcp FI_TCP_IFACE=nic0 UCX_RNDV_THRESH=${UCX_RNDV_THRESH:-inf}
    local status=0
    nsenter --uts="$RUN/uts/node0" ip netns exec node0 env -- "$@" || status=$?
    return "$status"
}

# ---------------------------------------------------------------------------------------------------- main
if [[ ${1:-} == --inside ]]; then
    shift
    inside "$@"
    exit $?
fi
if [[ ${1:-} == --probe ]]; then
    probe
    exit $?
fi
[[ $# -ge 5 && $4 == -- ]] || usage
# A shell started in the background ignores SIGINT and bash cannot trap a signal ignored on entry: restore it first.
if [[ -z ${_CLUSTER_SIGINT_RESET:-} ]] && env --default-signal=INT true 2>/dev/null; then
    exec env --default-signal=INT _CLUSTER_SIGINT_RESET=1 bash "$0" "$@"
fi
unset _CLUSTER_SIGINT_RESET
nodes=$1 rpn=$2 rate=$3
shift 4
[[ $nodes =~ ^[1-9][0-9]*$ && $nodes -le 250 ]] || die "NODES must be an integer in 1..250, got '$nodes'" 2
[[ $rpn =~ ^[1-9][0-9]*$ ]] || die "RANKS_PER_NODE must be a positive integer, got '$rpn'" 2
[[ $rate == unlimited ]] || rate_bits "$rate" >/dev/null || die "RATE must be a tc rate like 100mbit or 1gbit, or 'unlimited'; got '$rate'" 2
root=$(cd "$(dirname "$0")/.." && pwd)
mpiexec=${CLUSTER_MPIEXEC:-$root/.venv/bin/mpiexec}
[[ -x $mpiexec ]] || die "no mpiexec at $mpiexec (run 'make install', or set CLUSTER_MPIEXEC)"
probe || exit 1

# The chain: this script -> setpriv (SIGKILL when this script dies, however) -> unshare (--kill-child: SIGKILL to
# the namespaces' init when unshare dies) -> init. unshare blocks SIGTERM/SIGINT while it waits, so this script
# turns those into SIGKILL of unshare, which takes the whole cluster down with it.
# shellcheck disable=SC2046
setpriv --pdeathsig KILL -- unshare $(unshare_flags) --kill-child=KILL -- bash "$0" --inside "$nodes" "$rpn" "$rate" "$mpiexec" "$@" &
launcher=$!
stop() {
    kill -KILL "$launcher" 2>/dev/null || true
    wait "$launcher" 2>/dev/null || true
    echo "cluster.sh: stopped by SIG$1; the cluster is gone" >&2
    exit $((128 + $2))
}
trap 'stop TERM 15' TERM
trap 'stop INT 2' INT
trap 'stop HUP 1' HUP
status=0
wait "$launcher" || status=$?
exit "$status"
