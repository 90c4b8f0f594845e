#!/usr/bin/env bash
# An emulated cluster on this machine: N host and M device network
# namespaces, each with one veth pair into one Linux bridge (the switch),
# every link rate-limited with tbf in both directions, MTU 9000 by default.
# Optionally starts netdamd in every device namespace (in the network) and/or
# in every host namespace (co-located). See docs/CLUSTER.md.
#
#   scripts/cluster.sh [OPTIONS] up             build it; it stays until `down`
#   scripts/cluster.sh [--prefix P] down        tear it down (idempotent)
#   scripts/cluster.sh [--prefix P] status      nodes, addresses, qdiscs, daemons
#   scripts/cluster.sh [--prefix P] env         the CLUSTER_* variables (sourceable)
#   scripts/cluster.sh [--prefix P] exec NODE -- CMD...   run CMD in NODE (h0, d1, ...)
#   scripts/cluster.sh [--prefix P] [--loss-burst N] loss P
#                                               set the random loss of a cluster
#                                               that is up (same meaning as
#                                               --loss; 0 removes the rules),
#                                               without rebuilding it
#   scripts/cluster.sh [OPTIONS] run -- CMD...  up, run CMD in the root namespace
#                                               with CLUSTER_* set, tear down
#
#                 bridge <prefix>-br (no IP address, IGMP snooping and querier on)
#        .------------+-------------+--------------+-------------.
#   veth <prefix>-h0 ... <prefix>-h(N-1)    <prefix>-d0 ... <prefix>-d(M-1)
#    tbf: node's download            (bridge-side end)
#        |                                       |
#    eth0 in netns <prefix>-h0 ...           eth0 in netns <prefix>-d0 ...
#    tbf: node's upload              (node-side end)
#    10.X.Y.1 .. 10.X.Y.N                    10.X.Y.101 .. 10.X.Y.(100+M)
#
# Options (up/run):
#   --hosts N           host namespaces (default 4; 1..100)
#   --devices M         device namespaces (default 0; 0..100)
#   --rate RATE         link rate each way, tc units: 500mbit, 1gbit, 2.5gbit
#                       (decimal; "none": no rate limit; default 500mbit)
#   --mtu BYTES         MTU of every link and the bridge (default 9000)
#   --burst SIZE        tbf bucket, bytes (K/M suffixes binary; default 64K:
#                       one whole GSO packet, so tbf never has to split one;
#                       after an idle moment that much leaves at wire speed)
#   --queue SIZE|Tms    tbf queue: bytes, or a time at RATE (default 5ms, at
#                       least 2 buckets)
#   --priority DSCP     a switch with two queues per port: datagrams marked
#                       with this DSCP (0..63; netdam's small datagrams with
#                       --small-dscp) are sent before the rest. Each link is
#                       then an htb of RATE with two classes (the marked one
#                       first, either may use the whole rate), each with a
#                       queue of --queue bytes, instead of one tbf
#   --loss P            random packet loss: every node namespace (hosts and
#                       devices) drops a share P (0 <= P < 1; 0.01 = 1%) of the
#                       packets it receives on eth0, every protocol (TCP, UDP,
#                       ICMP; not IGMP, not ARP, never loopback), with an
#                       nftables rule (`numgen random`) in a table
#                       `inet netdam_loss` at its prerouting hook. Nothing in
#                       the root namespace. Any --loss, 0 too, also sets
#                       gso_max_segs 1 on every node's eth0, so that a packet
#                       is one wire frame for TCP and UDP alike (a GSO
#                       super-packet would be lost whole). Needs `nft`
#                       (Debian package nftables)
#   --loss-burst N      losses in bursts of N packets (default 1: each packet
#                       on its own): a packet a node receives starts a burst
#                       with probability q = P / (N - (N-1) P); a burst drops
#                       that packet and the next N-1 that node receives on
#                       eth0 (its link), whatever their flow. The long-run
#                       share dropped stays P, in runs of exactly N
#   --prefix NAME       names of everything it creates: namespaces NAME-h0,
#                       NAME-d0, bridge NAME-br (default ndc; [a-z0-9], 1..8
#                       chars, starting with a letter)
#   --subnet A.B.C.0/24 the cluster's /24 (default 10.214.K.0/24, K from the
#                       prefix); used only inside the cluster's namespaces
#   --netdamd           start netdamd in every device namespace
#   --colocated         start netdamd in every host namespace too
#   --port N            netdamd's UDP port (default 7000)
#   --memory SIZE       netdamd --memory (default 2GiB; touched lazily)
#   --max-payload N     netdamd --max-payload (default from the MTU: 8192 at 9000)
#   --netdamd-args STR  more netdamd arguments (word-split)
#   --build DIR         build tree with src/daemon/netdamd (default <repo>/build)
#
# `run` exports: CLUSTER_PREFIX CLUSTER_SUBNET CLUSTER_IFACE (eth0, inside every
# node) CLUSTER_MTU CLUSTER_RATE CLUSTER_RATE_BPS (0 = unlimited) CLUSTER_PRIORITY
# (--priority's DSCP, empty without) CLUSTER_LOSS (--loss's P; empty without)
# CLUSTER_LOSS_BURST CLUSTER_HOSTS
# CLUSTER_DEVICES CLUSTER_HOST_NS CLUSTER_HOST_IPS CLUSTER_DEVICE_NS
# CLUSTER_DEVICE_IPS (space-separated) CLUSTER_DEVICE_ADDRS
# CLUSTER_COLOCATED_ADDRS (IP:PORT, comma-separated, when daemons run)
# CLUSTER_STATE_DIR (logs) CLUSTER_SCRIPT (this script). `env` prints them.
#
# Everything is torn down on `down`, and by `run` on exit, Ctrl-C or failure;
# a failing `up` removes what it had built. `down` also kills any process
# still inside the cluster's namespaces.
#
# Exit status: 0 ok (`run`: the command's status), 64 usage, 65 a cluster with
# this prefix is already up, 66 no cluster with this prefix, 70 setup failed,
# 77 not root / no CAP_NET_ADMIN, 78 a tool is missing (ip, tc; nft with
# --loss), 79 the kernel lacks network namespaces, veth, the bridge, tbf (or
# nf_tables, with --loss).
set -uo pipefail

readonly EX_USAGE=64 EX_EXISTS=65 EX_NOTUP=66 EX_SETUP=70 EX_NOPERM=77 EX_NOTOOL=78 EX_NOKERNEL=79
SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
readonly SCRIPT REPO
readonly STATE_ROOT="${CLUSTER_STATE_ROOT:-/run/netdam-cluster}"

hosts=4 devices=0 rate=500mbit mtu=9000 burst="" queue=5ms priority="" prefix=ndc subnet=""
netdamd=0 colocated=0 port=7000 memory=2GiB max_payload="" netdamd_args="" build="$REPO/build"
loss="" loss_burst=""
sub="" node="" cmd=()

die() {  # die STATUS MESSAGE
  local st=$1; shift
  echo "cluster.sh: $*" >&2
  exit "$st"
}
log() { [[ -n "${CLUSTER_QUIET:-}" ]] || echo "cluster.sh: $*" >&2; }

usage() { sed -n '2,/^set -uo/p' "$SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'; }

# ----------------------------------------------------------------- parsing ---

while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --hosts) hosts=${2:-}; shift 2 ;;
    --devices) devices=${2:-}; shift 2 ;;
    --rate) rate=${2:-}; shift 2 ;;
    --mtu) mtu=${2:-}; shift 2 ;;
    --burst) burst=${2:-}; shift 2 ;;
    --queue) queue=${2:-}; shift 2 ;;
    --priority) priority=${2:-}; shift 2 ;;
    --loss) loss=${2:-}; shift 2 ;;
    --loss-burst) loss_burst=${2:-}; shift 2 ;;
    --prefix) prefix=${2:-}; shift 2 ;;
    --subnet) subnet=${2:-}; shift 2 ;;
    --netdamd) netdamd=1; shift ;;
    --colocated) colocated=1; shift ;;
    --port) port=${2:-}; shift 2 ;;
    --memory) memory=${2:-}; shift 2 ;;
    --max-payload) max_payload=${2:-}; shift 2 ;;
    --netdamd-args) netdamd_args=${2:-}; shift 2 ;;
    --build) build=${2:-}; shift 2 ;;
    --) shift; cmd=("$@"); break ;;
    -*) die $EX_USAGE "unknown option '$1' (--help)" ;;
    *)
      if [[ -z "$sub" ]]; then sub=$1
      elif [[ "$sub" == exec && -z "$node" ]]; then node=$1
      elif [[ "$sub" == loss && -z "$loss" ]]; then loss=$1
      else die $EX_USAGE "unexpected '$1' (commands go after --)"
      fi
      shift ;;
  esac
done

[[ -n "$sub" ]] || { usage >&2; exit $EX_USAGE; }
[[ "$prefix" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die $EX_USAGE "--prefix: 1..8 of [a-z0-9], starting with a letter"
[[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 100)) || die $EX_USAGE "--hosts: 1..100"
[[ "$devices" =~ ^[0-9]+$ ]] && ((devices <= 100)) || die $EX_USAGE "--devices: 0..100"
[[ "$mtu" =~ ^[0-9]+$ ]] && ((mtu >= 576 && mtu <= 65535)) || die $EX_USAGE "--mtu: 576..65535"
[[ "$port" =~ ^[0-9]+$ ]] && ((port >= 1 && port <= 65535)) || die $EX_USAGE "--port: 1..65535"
[[ -z "$priority" ]] || { [[ "$priority" =~ ^[0-9]+$ ]] && ((priority <= 63)); } || die $EX_USAGE "--priority: a DSCP, 0..63"

# --loss P / --loss-burst N. The rule draws `numgen random mod LOSS_SCALE`:
# q is applied in millionths.
readonly LOSS_SCALE=1000000
loss_k=0
if [[ -n "$loss_burst" && -z "$loss" ]]; then
  [[ "$sub" == loss ]] && die $EX_USAGE "loss P: the probability P is missing (e.g. loss 0.01)"
  die $EX_USAGE "--loss-burst needs --loss P"
fi
if [[ "$sub" == loss && -z "$loss" ]]; then die $EX_USAGE "loss P: the probability P is missing (e.g. loss 0.01)"; fi
if [[ -n "$loss" ]]; then
  [[ "$loss" =~ ^([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] &&
    awk -v p="$loss" 'BEGIN { exit !(p + 0 >= 0 && p + 0 < 1) }' ||
    die $EX_USAGE "--loss: a probability in [0, 1), e.g. 0.01 for 1% (got '$loss')"
  loss_burst=${loss_burst:-1}
  [[ "$loss_burst" =~ ^[0-9]+$ ]] && ((10#$loss_burst >= 1 && 10#$loss_burst <= 1000)) ||
    die $EX_USAGE "--loss-burst: a whole number of packets, 1..1000 (got '$loss_burst')"
  loss_burst=$((10#$loss_burst))
  # A burst of N starts with probability q on a packet outside a burst: per
  # cycle q N packets are lost out of q N + (1 - q), a share P for
  # q = P / (N - (N - 1) P).
  loss_k=$(awk -v p="$loss" -v n="$loss_burst" -v s=$LOSS_SCALE 'BEGIN { printf "%d", p / (n - (n - 1) * p) * s + 0.5 }')
  if awk -v p="$loss" 'BEGIN { exit !(p + 0 > 0) }' && ((loss_k == 0)); then
    die $EX_USAGE "--loss $loss is below the resolution of the rule (a burst starts with probability >= 1e-6)"
  fi
  loss=$(awk -v p="$loss" 'BEGIN { printf "%.6g", p }')
fi

# Bytes from "64K", "1M", "65536" (binary suffixes).
to_bytes() {
  local v=${1^^}
  [[ "$v" =~ ^([0-9]+)(K|KB|KIB|M|MB|MIB|G|GB|GIB)?$ ]] || return 1
  local n=${BASH_REMATCH[1]} u=${BASH_REMATCH[2]}
  case "$u" in
    K*) echo $((n << 10)) ;; M*) echo $((n << 20)) ;; G*) echo $((n << 30)) ;; *) echo "$n" ;;
  esac
}

# Bits per second from tc's decimal units (bit, kbit, mbit, gbit, tbit).
rate_bps=0
if [[ "$rate" != none ]]; then
  [[ "${rate,,}" =~ ^([0-9]+(\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit)$ ]] ||
    die $EX_USAGE "--rate: a number with bit, kbit, mbit, gbit or tbit (decimal), or none"
  case "${BASH_REMATCH[3]}" in
    bit) mul=1 ;; kbit) mul=1000 ;; mbit) mul=1000000 ;; gbit) mul=1000000000 ;; tbit) mul=1000000000000 ;;
  esac
  rate_bps=$(awk -v n="${BASH_REMATCH[1]}" -v m="$mul" 'BEGIN { printf "%.0f", n * m }')
  ((rate_bps >= 8000)) || die $EX_USAGE "--rate: at least 8kbit"
  rate=${rate,,}
fi

if [[ -z "$burst" ]]; then
  # A whole 64 KB GSO packet: a smaller bucket makes tbf segment every TCP
  # super-packet in software (2 frames of 9000: 4x the softirq time at 1gbit).
  burst_bytes=65536
  ((burst_bytes >= mtu + 14)) || burst_bytes=$((mtu + 14))
else
  burst_bytes=$(to_bytes "$burst") || die $EX_USAGE "--burst: bytes, e.g. 131072 or 128K"
fi
((burst_bytes >= mtu + 14)) || die $EX_USAGE "--burst must hold one frame (MTU + 14 bytes)"
# The queue holds at least two buckets: a TCP GSO packet (up to 64 KB) that
# does not fit the queue is dropped whole, and TCP then waits for a timeout.
if [[ "$queue" =~ ^([0-9]+)ms$ ]]; then
  queue_bytes=$(( rate_bps / 8 * BASH_REMATCH[1] / 1000 ))
  ((queue_bytes >= 2 * burst_bytes)) || queue_bytes=$((2 * burst_bytes))
else
  queue_bytes=$(to_bytes "$queue") || die $EX_USAGE "--queue: bytes (128K) or milliseconds (5ms)"
  ((queue_bytes >= burst_bytes)) || die $EX_USAGE "--queue must hold at least one bucket (--burst)"
fi

if [[ -z "$max_payload" ]]; then
  # Largest multiple of 1 KiB that fits a datagram with netdam's 40-byte header,
  # a segment-routing preamble (room left: 256 B), UDP and IPv4 headers: 8192 at 9000.
  max_payload=$(( (mtu - 28 - 40 - 256) / 1024 * 1024 ))
  ((max_payload >= 512)) || max_payload=512
fi

# The /24: 10.214.K.0/24 with K from the prefix, unless given.
if [[ -z "$subnet" ]]; then
  k=$(( $(printf '%s' "$prefix" | cksum | cut -d' ' -f1) % 250 + 1 ))
  subnet="10.214.$k.0/24"
fi
[[ "$subnet" =~ ^(10|172|192)\.([0-9]{1,3})\.([0-9]{1,3})\.0/24$ ]] ||
  die $EX_USAGE "--subnet: a private A.B.C.0/24 (e.g. 10.214.7.0/24)"
net3=${subnet%.0/24}
((${BASH_REMATCH[2]} <= 255 && ${BASH_REMATCH[3]} <= 255)) || die $EX_USAGE "--subnet: bad address"

state="$STATE_ROOT/$prefix"
bridge="$prefix-br"
host_ns() { echo "$prefix-h$1"; }
dev_ns() { echo "$prefix-d$1"; }
host_ip() { echo "$net3.$(($1 + 1))"; }
dev_ip() { echo "$net3.$(($1 + 101))"; }

# ---------------------------------------------------------------- checks ---

need_root() {
  [[ "$(id -u)" == 0 ]] ||
    die $EX_NOPERM "needs root (network namespaces, veth, bridge and tc need CAP_NET_ADMIN); run it with sudo"
}

IP="" TC=""
need_tools() {
  IP=$(command -v ip) || die $EX_NOTOOL "'ip' (iproute2) not found: apt-get install iproute2"
  TC=$(command -v tc) || die $EX_NOTOOL "'tc' (iproute2) not found: apt-get install iproute2"
  "$IP" netns list >/dev/null 2>&1 ||
    die $EX_NOKERNEL "'ip netns list' fails: this kernel or container has no network namespaces"
}

NFT=""
need_nft() {  # --loss: the rules are nftables rules
  NFT=$(command -v nft) ||
    die $EX_NOTOOL "'nft' (nftables) not found, and --loss needs it: apt-get install nftables (scripts/setup.sh installs it)"
}

# Classifies a failed creation step: permission, missing kernel support, other.
fail_step() {  # fail_step WHAT OUTPUT
  local what=$1 out=$2
  if [[ "$out" == *"Operation not permitted"* || "$out" == *"Permission denied"* ]]; then
    die $EX_NOPERM "$what: $out (needs CAP_NET_ADMIN)"
  elif [[ "$out" == *"Unknown device type"* || "$out" == *"qdisc kind is unknown"* ||
          "$out" == *"not supported"* || "$out" == *"Not supported"* || "$out" == *"No such file"* ||
          "$out" == *"classifier not found"* || "$out" == *"Protocol not supported"* ]]; then
    die $EX_NOKERNEL "$what: $out (the kernel lacks it; bridge, veth, tbf and network namespaces are needed, and nf_tables with --loss)"
  fi
  die $EX_SETUP "$what: $out"
}

step() {  # step WHAT CMD...: run, fail_step on error
  local what=$1 out; shift
  out=$("$@" 2>&1) || fail_step "$what" "${out:-exit $?}"
}

# ---------------------------------------------------------------- teardown ---

# Removes everything named after $prefix: daemons, processes left in the
# namespaces, the namespaces (which takes the veth pairs), the bridge, the
# state. Safe to run twice and on a half-built cluster.
teardown() {
  local ip=${IP:-$(command -v ip || echo ip)} pidf pid ns pids
  if [[ -d "$state" ]]; then
    for pidf in "$state"/*.pid; do
      [[ -f "$pidf" ]] || continue
      pid=$(<"$pidf")
      [[ "$pid" =~ ^[0-9]+$ ]] && kill -TERM "$pid" 2>/dev/null
    done
  fi
  local all_ns
  all_ns=$("$ip" netns list 2>/dev/null | awk '{print $1}' | grep -E "^$prefix-[hd][0-9]+$" || true)
  for ns in $all_ns; do
    pids=$("$ip" netns pids "$ns" 2>/dev/null || true)
    [[ -n "$pids" ]] && kill -TERM $pids 2>/dev/null
  done
  # Up to 2 s for them to exit, then KILL.
  for _ in $(seq 20); do
    local left=""
    for ns in $all_ns; do left+=$("$ip" netns pids "$ns" 2>/dev/null || true); done
    [[ -z "$left" ]] && break
    sleep 0.1
  done
  for ns in $all_ns; do
    pids=$("$ip" netns pids "$ns" 2>/dev/null || true)
    [[ -n "$pids" ]] && kill -KILL $pids 2>/dev/null
    "$ip" netns del "$ns" 2>/dev/null
  done
  # Root-side veth ends go with their namespaces; anything stray goes here.
  local link
  for link in $("$ip" -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 |
                grep -E "^$prefix-([hd][0-9]+|br)$" || true); do
    "$ip" link del "$link" 2>/dev/null
  done
  rm -rf "$state"
}

# ------------------------------------------------------------------- build ---

# The sysctls of an interface or namespace we created: no IPv6 (no router
# or neighbour solicitations, no MLD on the links).
quiet_ipv6() {  # quiet_ipv6 [NS]
  if [[ -n "${1:-}" ]]; then
    "$IP" netns exec "$1" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 net.ipv6.conf.default.disable_ipv6=1 >/dev/null 2>&1
  fi
  return 0
}

tbf() {  # tbf WHAT DEV [netns]
  local what=$1 dev=$2 ns=${3:-}
  ((rate_bps > 0)) || return 0
  local in_ns=()
  [[ -n "$ns" ]] && in_ns=(-n "$ns")
  if [[ -n "$priority" ]]; then
    two_queues "$what" "$dev" "${in_ns[@]}"
    return
  fi
  step "$what: tc qdisc add dev $dev root tbf rate $rate" \
    "$TC" "${in_ns[@]}" qdisc add dev "$dev" root tbf rate "$rate" burst "$burst_bytes" limit "$queue_bytes"
}

# --priority: htb at the link's rate with two classes. HTB serves the
# lower `prio` first whenever both may send; each class is guaranteed half
# the rate and may borrow the whole of it, so the marked class (small
# datagrams, a trickle) never waits behind the other's queue, and the other
# has the link to itself when nothing is marked.
two_queues() {  # two_queues WHAT DEV [-n NS]
  local what=$1 dev=$2; shift 2
  local half=$((rate_bps / 2)) q=(quantum "$burst_bytes")
  step "$what: htb root" "$TC" "$@" qdisc add dev "$dev" root handle 1: htb default 20
  step "$what: htb link class" "$TC" "$@" class add dev "$dev" parent 1: classid 1:1 htb \
    rate "${rate_bps}bit" ceil "${rate_bps}bit" burst "$burst_bytes" cburst "$burst_bytes" "${q[@]}"
  step "$what: marked class" "$TC" "$@" class add dev "$dev" parent 1:1 classid 1:10 htb prio 0 \
    rate "${half}bit" ceil "${rate_bps}bit" burst "$burst_bytes" cburst "$burst_bytes" "${q[@]}"
  step "$what: bulk class" "$TC" "$@" class add dev "$dev" parent 1:1 classid 1:20 htb prio 1 \
    rate "$((rate_bps - half))bit" ceil "${rate_bps}bit" burst "$burst_bytes" cburst "$burst_bytes" "${q[@]}"
  step "$what: marked queue" "$TC" "$@" qdisc add dev "$dev" parent 1:10 handle 10: bfifo limit "$queue_bytes"
  step "$what: bulk queue" "$TC" "$@" qdisc add dev "$dev" parent 1:20 handle 20: bfifo limit "$queue_bytes"
  # The DSCP is the TOS byte's upper six bits.
  step "$what: DSCP $priority filter" "$TC" "$@" filter add dev "$dev" parent 1: protocol ip prio 1 u32 \
    match ip tos $((priority << 2)) 0xfc flowid 1:10
}

add_node() {  # add_node NS IP
  local ns=$1 addr=$2
  step "ip netns add $ns" "$IP" netns add "$ns"
  quiet_ipv6 "$ns"
  step "veth $ns" "$IP" link add "$ns" mtu "$mtu" type veth peer name eth0 mtu "$mtu" netns "$ns"
  sysctl -qw "net.ipv6.conf.$ns.disable_ipv6=1" >/dev/null 2>&1
  step "attach $ns to $bridge" "$IP" link set "$ns" master "$bridge" up
  step "$ns: lo up" "$IP" -n "$ns" link set lo up
  step "$ns: address $addr" "$IP" -n "$ns" addr add "$addr/24" dev eth0
  step "$ns: eth0 up" "$IP" -n "$ns" link set eth0 multicast on up
  step "$ns: multicast route" "$IP" -n "$ns" route add 224.0.0.0/4 dev eth0
  tbf "$ns upload" eth0 "$ns"       # what the node sends
  tbf "$ns download" "$ns"          # what the bridge sends to the node
}

# --loss: the nftables table of one node namespace, replaced in one
# transaction (the first line makes sure there is one to delete). Packets
# from eth0 only (never lo), IGMP excepted (the switch's membership table is
# not a link: a lost report or query would cut a multicast group off for the
# 260 s of a membership, not one packet). Counters: rx = packets seen on
# eth0, lost = packets dropped. Burst state: the set `burst` holds "eth0"
# while a burst lasts; `numgen inc` counts the packets dropped inside bursts
# (only those reach it), so the N-1th after the one that started it ends it.
loss_ruleset() {
  local k=$loss_k n=$loss_burst
  echo "table inet netdam_loss"
  echo "delete table inet netdam_loss"
  echo "table inet netdam_loss {"
  echo "  counter rx {"
  echo "  }"
  echo "  counter lost {"
  echo "  }"
  if ((n > 1)); then
    echo "  set burst {"
    echo "    type ifname; flags dynamic;"
    echo "  }"
  fi
  echo "  chain ingress {"
  echo "    type filter hook prerouting priority raw; policy accept;"
  echo "    iifname != \"eth0\" accept"
  echo "    meta l4proto igmp accept"
  echo "    counter name \"rx\""
  if ((n > 1)); then
    echo "    iifname @burst jump in_burst"
    echo "    numgen random mod $LOSS_SCALE < $k add @burst { iifname } counter name \"lost\" drop"
  else
    echo "    numgen random mod $LOSS_SCALE < $k counter name \"lost\" drop"
  fi
  echo "  }"
  if ((n > 1)); then
    echo "  chain in_burst {"
    echo "    numgen inc mod $((n - 1)) $((n - 2)) delete @burst { iifname }"
    echo "    counter name \"lost\" drop"
    echo "  }"
  fi
  echo "}"
}

set_loss() {  # set_loss NS: the --loss rules of NS (none for P = 0)
  local ns=$1
  # One wire frame per packet: segment GSO super-packets (TCP's, and UDP
  # GSO trains) at eth0's transmit, so that the receiver's rule sees and
  # drops frames, not up to 7 of them at once.
  step "$ns: gso_max_segs 1" "$IP" -n "$ns" link set dev eth0 gso_max_segs 1
  if ((loss_k > 0)); then
    step "$ns: nft loss rules" "$IP" netns exec "$ns" "$NFT" -f - < <(loss_ruleset)
  else
    "$IP" netns exec "$ns" "$NFT" list table inet netdam_loss >/dev/null 2>&1 || return 0
    step "$ns: nft delete table" "$IP" netns exec "$ns" "$NFT" delete table inet netdam_loss
  fi
}

loss_counters() {  # loss_counters NS -> "RX LOST" (packets), "- -" without rules
  local out
  out=$("$IP" netns exec "$1" "${NFT:-nft}" list table inet netdam_loss 2>/dev/null) || { echo "- -"; return; }
  awk '/counter rx/ {c = "rx"} /counter lost/ {c = "lost"}
       /packets/ && c { v[c] = $2; c = "" }
       END { print (v["rx"] == "" ? 0 : v["rx"]), (v["lost"] == "" ? 0 : v["lost"]) }' <<<"$out"
}

loss_words() {  # how the log and status say the loss
  [[ -n "$loss" ]] || { echo "no loss"; return; }
  if ((loss_burst > 1)); then
    echo "loss $loss in bursts of $loss_burst (a burst starts with q = $(awk -v p="$loss" -v n="$loss_burst" -v s=$LOSS_SCALE 'BEGIN { printf "%g", int(p / (n - (n - 1) * p) * s + 0.5) / s }'))"
  else
    echo "loss $loss"
  fi
}

start_netdamd() {  # start_netdamd NAME NS IP
  local name=$1 ns=$2 addr=$3 bin="$build/src/daemon/netdamd"
  rm -f "$state/$name.port"
  # shellcheck disable=SC2086
  "$IP" netns exec "$ns" "$bin" --listen "$addr:$port" --memory "$memory" --admin-key 0xAD \
    --max-payload "$max_payload" --port-file "$state/$name.port" --log-level warn $netdamd_args \
    </dev/null >"$state/$name.log" 2>&1 &
  echo $! >"$state/$name.pid"
}

wait_netdamd() {  # wait_netdamd NAME
  local name=$1 pid
  pid=$(<"$state/$name.pid")
  for _ in $(seq 200); do
    [[ -s "$state/$name.port" ]] && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  die $EX_SETUP "netdamd $name did not start: $(tail -3 "$state/$name.log" 2>/dev/null)"
}

join_by() { local IFS=$1; shift; echo "$*"; }

# NAME='VALUE' (no value here holds a quote).
kv() { printf "%s='%s'\n" "$1" "$2"; }

write_env() {
  local hn=() hi=() dn=() di=() da=() ca=() i
  for ((i = 0; i < hosts; i++)); do hn+=("$(host_ns $i)"); hi+=("$(host_ip $i)"); done
  for ((i = 0; i < devices; i++)); do dn+=("$(dev_ns $i)"); di+=("$(dev_ip $i)"); done
  if ((netdamd)); then for ((i = 0; i < devices; i++)); do da+=("$(dev_ip $i):$port"); done; fi
  if ((colocated)); then for ((i = 0; i < hosts; i++)); do ca+=("$(host_ip $i):$port"); done; fi
  {
    kv CLUSTER_PREFIX "$prefix"
    kv CLUSTER_SUBNET "$subnet"
    printf 'CLUSTER_IFACE=eth0\n'
    kv CLUSTER_BRIDGE "$bridge"
    kv CLUSTER_MTU "$mtu"
    kv CLUSTER_RATE "$rate"
    kv CLUSTER_RATE_BPS "$rate_bps"
    kv CLUSTER_PRIORITY "$priority"
    kv CLUSTER_LOSS "$loss"
    kv CLUSTER_LOSS_BURST "${loss_burst:-1}"
    kv CLUSTER_BURST "$burst_bytes"
    kv CLUSTER_QUEUE "$queue_bytes"
    kv CLUSTER_HOSTS "$hosts"
    kv CLUSTER_DEVICES "$devices"
    kv CLUSTER_HOST_NS "${hn[*]-}"
    kv CLUSTER_HOST_IPS "${hi[*]-}"
    kv CLUSTER_DEVICE_NS "${dn[*]-}"
    kv CLUSTER_DEVICE_IPS "${di[*]-}"
    kv CLUSTER_DEVICE_ADDRS "$(join_by , "${da[@]-}")"
    kv CLUSTER_COLOCATED_ADDRS "$(join_by , "${ca[@]-}")"
    kv CLUSTER_MAX_PAYLOAD "$max_payload"
    kv CLUSTER_STATE_DIR "$state"
    kv CLUSTER_SCRIPT "$SCRIPT"
  } >"$state/env"
}

building=0   # 1: a failing or interrupted `up`; 2: `run`, whose end takes the cluster down
on_exit() {
  local st=$?
  if ((building == 1)); then
    log "setup did not finish (exit $st): tearing down what was built"
    teardown
  elif ((building == 2)); then
    teardown
    log "run: '$prefix' torn down (exit $st)"
  fi
  exit "$st"
}

cluster_up() {
  need_root
  need_tools
  [[ -z "$loss" ]] || need_nft
  if ((netdamd || colocated)); then
    [[ -x "$build/src/daemon/netdamd" ]] ||
      die $EX_SETUP "no $build/src/daemon/netdamd: build it (ninja -C build netdamd) or pass --build DIR"
  fi
  mkdir -p "$STATE_ROOT"
  # mkdir is the lock: two `up`s with one prefix cannot both win.
  mkdir "$state" 2>/dev/null ||
    die $EX_EXISTS "a cluster '$prefix' is already up (state in $state): '$0 --prefix $prefix down' first"
  if "$IP" link show "$bridge" >/dev/null 2>&1; then
    rmdir "$state"
    die $EX_EXISTS "an interface '$bridge' already exists: '$0 --prefix $prefix down' first, or another --prefix"
  fi
  building=1
  trap on_exit EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  trap 'exit 129' HUP

  # IGMP snooping, as a data-center switch does: a group's datagrams go to
  # the ports whose nodes joined it, not to every port (aggregation results
  # by multicast would otherwise load every device's download link with
  # the other devices' results: 56% of the bound instead of 97% at 64 MiB,
  # p = 4); the bridge is the querier, so memberships stay fresh.
  step "bridge $bridge" "$IP" link add "$bridge" mtu "$mtu" type bridge mcast_snooping 1 mcast_querier 1 stp_state 0 forward_delay 0
  sysctl -qw "net.ipv6.conf.$bridge.disable_ipv6=1" >/dev/null 2>&1
  step "bridge $bridge up" "$IP" link set "$bridge" multicast on up
  local i
  for ((i = 0; i < hosts; i++)); do add_node "$(host_ns $i)" "$(host_ip $i)"; done
  for ((i = 0; i < devices; i++)); do
    add_node "$(dev_ns $i)" "$(dev_ip $i)"
    # Until the bridge's querier is up (some seconds; it then forwards by
    # membership only), it floods multicast to every port that allows it:
    # not to the devices, which get a group's datagrams only once they
    # joined it and the querier knows.
    step "$(dev_ns $i): no multicast flooding" "$IP" link set dev "$(dev_ns $i)" type bridge_slave mcast_flood off
  done
  if [[ -n "$loss" ]]; then
    for ((i = 0; i < hosts; i++)); do set_loss "$(host_ns $i)"; done
    for ((i = 0; i < devices; i++)); do set_loss "$(dev_ns $i)"; done
  fi
  if ((netdamd)); then
    for ((i = 0; i < devices; i++)); do start_netdamd "d$i" "$(dev_ns $i)" "$(dev_ip $i)"; done
  fi
  if ((colocated)); then
    for ((i = 0; i < hosts; i++)); do start_netdamd "h$i" "$(host_ns $i)" "$(host_ip $i)"; done
  fi
  if ((netdamd)); then for ((i = 0; i < devices; i++)); do wait_netdamd "d$i"; done; fi
  if ((colocated)); then for ((i = 0; i < hosts; i++)); do wait_netdamd "h$i"; done; fi
  write_env
  building=0
  log "up: '$prefix', $hosts hosts + $devices devices on $bridge, $subnet, rate ${rate} each way" \
      "(burst $burst_bytes B, queue $queue_bytes B), MTU $mtu, $(loss_words)"
}

load_state() {
  [[ -f "$state/env" ]] || die $EX_NOTUP "no cluster '$prefix' is up (no $state/env)"
  # shellcheck disable=SC1091
  source "$state/env"
}

node_ns() {  # NODE (h0, d1 or a full namespace name) -> namespace
  local n=$1
  if [[ "$n" =~ ^[hd][0-9]+$ ]]; then n="$CLUSTER_PREFIX-$n"; fi
  [[ " $CLUSTER_HOST_NS $CLUSTER_DEVICE_NS " == *" $n "* ]] ||
    die $EX_USAGE "no node '$1' in cluster '$CLUSTER_PREFIX' (nodes: h0..h$((CLUSTER_HOSTS - 1))$( ((CLUSTER_DEVICES)) && echo ", d0..d$((CLUSTER_DEVICES - 1))"))"
  echo "$n"
}

# ---------------------------------------------------------------- commands ---

case "$sub" in
  up)
    ((${#cmd[@]} == 0)) || die $EX_USAGE "up takes no command (use run)"
    cluster_up
    trap - EXIT INT TERM HUP
    echo "$state/env"
    ;;
  down)
    need_root
    need_tools
    teardown
    log "down: '$prefix' removed"
    ;;
  env)
    load_state
    cat "$state/env"
    ;;
  status)
    need_root
    need_tools
    load_state
    loss=${CLUSTER_LOSS:-} loss_burst=${CLUSTER_LOSS_BURST:-1}
    echo "cluster '$CLUSTER_PREFIX': $CLUSTER_HOSTS hosts, $CLUSTER_DEVICES devices, bridge $CLUSTER_BRIDGE," \
         "$CLUSTER_SUBNET, rate $CLUSTER_RATE each way, MTU $CLUSTER_MTU, $(loss_words)"
    printf '%-12s %-14s %-6s %14s %8s %14s %8s %10s %8s\n' node ip netdamd "up sent B" "up drop" \
      "down sent B" "dn drop" "nft rx" "nft lost"
    for ns in $CLUSTER_HOST_NS $CLUSTER_DEVICE_NS; do
      addr=$("$IP" -n "$ns" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}' | cut -d/ -f1)
      upl=$("$TC" -n "$ns" -s qdisc show dev eth0 2>/dev/null | awk '/Sent/ {print $2, $7; exit}' | tr -d ,)
      dnl=$("$TC" -s qdisc show dev "$ns" 2>/dev/null | awk '/Sent/ {print $2, $7; exit}' | tr -d ,)
      short=${ns#"$CLUSTER_PREFIX"-}
      d="-"
      if [[ -f "$CLUSTER_STATE_DIR/$short.pid" ]]; then
        pid=$(<"$CLUSTER_STATE_DIR/$short.pid")
        if kill -0 "$pid" 2>/dev/null; then d="$pid"; else d="dead"; fi
      fi
      # shellcheck disable=SC2046  # (two words each: bytes and drops, rx and lost)
      printf '%-12s %-14s %-6s %14s %8s %14s %8s %10s %8s\n' "$ns" "${addr:-?}" "$d" \
        ${upl:-"- -"} ${dnl:-"- -"} $(loss_counters "$ns")
    done
    ;;
  loss)
    ((${#cmd[@]} == 0)) || die $EX_USAGE "loss P takes no command"
    need_root
    need_tools
    need_nft
    load_state
    for ns in $CLUSTER_HOST_NS $CLUSTER_DEVICE_NS; do set_loss "$ns"; done
    # The state follows (the rest of env as it was).
    sed -i -e "s/^CLUSTER_LOSS=.*/CLUSTER_LOSS='$loss'/" -e "s/^CLUSTER_LOSS_BURST=.*/CLUSTER_LOSS_BURST='$loss_burst'/" \
      "$CLUSTER_STATE_DIR/env"
    grep -q '^CLUSTER_LOSS=' "$CLUSTER_STATE_DIR/env" || kv CLUSTER_LOSS "$loss" >>"$CLUSTER_STATE_DIR/env"
    grep -q '^CLUSTER_LOSS_BURST=' "$CLUSTER_STATE_DIR/env" || kv CLUSTER_LOSS_BURST "$loss_burst" >>"$CLUSTER_STATE_DIR/env"
    log "loss: '$CLUSTER_PREFIX', $(loss_words) on every node's eth0 (counters reset)"
    ;;
  exec)
    [[ -n "$node" ]] || die $EX_USAGE "exec NODE -- CMD..."
    ((${#cmd[@]})) || die $EX_USAGE "exec NODE -- CMD..."
    need_root
    need_tools
    load_state
    ns=$(node_ns "$node") || exit $?
    exec "$IP" netns exec "$ns" "${cmd[@]}"
    ;;
  run)
    ((${#cmd[@]})) || die $EX_USAGE "run -- CMD..."
    cluster_up
    # From here the cluster goes on any exit: the command's end, a failure,
    # Ctrl-C (which reaches the command too: same process group), SIGTERM or
    # SIGHUP (forwarded to the command). The command runs as a background
    # job so that a signal need not wait for it, with SIGINT and SIGQUIT back
    # to their defaults (bash ignores them in background jobs) and this
    # shell's standard input.
    building=2
    set -a
    # shellcheck disable=SC1091
    source "$state/env"
    set +a
    child="" got=""
    forward() { got=$1; [[ -n "$child" ]] && kill -s "$1" "$child" 2>/dev/null; }
    trap 'forward INT' INT
    trap 'forward TERM' TERM
    trap 'forward HUP' HUP
    defaults=()
    env --default-signal=INT true 2>/dev/null && defaults=(env "--default-signal=INT,QUIT")
    "${defaults[@]}" "${cmd[@]}" <&0 &
    child=$!
    while :; do
      wait "$child"
      st=$?
      kill -0 "$child" 2>/dev/null || break   # else a trapped signal interrupted the wait
    done
    if [[ -n "$got" ]]; then
      wait "$child" 2>/dev/null
      s2=$?
      ((s2 != 127)) && st=$s2
    fi
    exit "$st"
    ;;
  *)
    die $EX_USAGE "unknown command '$sub' (up, down, status, env, exec, run, loss; --help)"
    ;;
esac
