#!/usr/bin/env bash
# CTest test of the Wireshark dissector (tools/wireshark/netdam.lua): a
# netdamd and a netdam-mmu on loopback ports the kernel picks, real traffic
# from the `netdam` CLI and from send_raw.py (a chain, ARM, OPT_*, AGGREGATE,
# a datagram with a bad trailer), captured on lo with dumpcap and decoded by
# tshark with the plugin; then the decoded field values are compared with
# what was sent. Exits 77 (skipped) without tshark/dumpcap or the right to
# capture. About 5 s.
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="${NETDAM_BUILD_DIR:-$repo/build}"
lua="${NETDAM_WIRESHARK_LUA:-$repo/tools/wireshark/netdam.lua}"  # or an installed copy
netdamd="$build/src/daemon/netdamd"
cli="$build/src/tools/netdam"
mmu="$build/src/mmu/netdam-mmu"
py=/usr/bin/python3
[[ -x "$py" ]] || py=$(command -v python3)

for tool in tshark dumpcap; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool is not installed (apt-get install tshark)"; exit 77; }
done
if [[ "$(id -u)" != 0 ]] && ! dumpcap -D 2>/dev/null | grep -qw lo; then
  echo "SKIP: cannot capture on lo (not root and dumpcap lacks the capability)"; exit 77
fi
for bin in "$netdamd" "$cli" "$mmu"; do
  [[ -x "$bin" ]] || { echo "FAIL: $bin not built (set NETDAM_BUILD_DIR)"; exit 1; }
done

work=$(mktemp -d)
pids=()
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  # NETDAM_WIRESHARK_KEEP=FILE keeps the capture: a ready example to open.
  [[ -n "${NETDAM_WIRESHARK_KEEP:-}" && -s "$work/cap.pcapng" ]] && cp "$work/cap.pcapng" "$NETDAM_WIRESHARK_KEEP"
  rm -rf "$work"
}
trap cleanup EXIT

wait_file() {  # wait_file F: until F is non-empty, at most 5 s
  for _ in $(seq 50); do [[ -s "$1" ]] && return 0; sleep 0.1; done
  return 1
}

# ------------------------------------------------------- daemons, capture ---
# Key 7 for plain requests, 9 and 10 for chains (the implicit key 1 would
# refuse them), an admin key for REGION_* and for the proxy.
# A second device for a chain that hops; one cookie secret for both, so the
# cookie the first gives validates a chain at the second (PROTOCOL.md 9.6).
secret=000102030405060708090a0b0c0d0e0f
"$netdamd" --listen 127.0.0.1:0 --port-file "$work/dev.port" --memory 1MiB --admin-key 0xAD \
  --cookie-secret $secret --region 0:64KiB:7 --region 64KiB:64KiB:9 --region 128KiB:64KiB:10 \
  >"$work/netdamd.log" 2>&1 &
pids+=("$!")
"$netdamd" --listen 127.0.0.1:0 --port-file "$work/dev2.port" --memory 1MiB --cookie-secret $secret \
  --region 64KiB:64KiB:9 >"$work/netdamd2.log" 2>&1 &
pids+=("$!")
wait_file "$work/dev.port" || { cat "$work/netdamd.log"; echo "FAIL: netdamd did not start"; exit 1; }
wait_file "$work/dev2.port" || { cat "$work/netdamd2.log"; echo "FAIL: netdamd 2 did not start"; exit 1; }
dev=$(cat "$work/dev.port")
dev2=$(cat "$work/dev2.port")
"$mmu" --listen 127.0.0.1:0 --port-file "$work/mmu.port" --device "$dev" --device-admin-key 0xAD \
  --device-min-rto-us 50000 --insecure >"$work/mmu.log" 2>&1 &
pids+=("$!")
wait_file "$work/mmu.port" || { cat "$work/mmu.log"; echo "FAIL: netdam-mmu did not start"; exit 1; }
proxy=$(cat "$work/mmu.port")

cap="$work/cap.pcapng"
dumpcap -q -i lo -f "udp port ${dev##*:} or udp port ${dev2##*:} or udp port ${proxy##*:}" -w "$cap" 2>"$work/dumpcap.log" &
dumpcap_pid=$!
pids+=("$dumpcap_pid")
# dumpcap says so once the filter is installed; traffic before that is lost.
for _ in $(seq 50); do
  grep -q "Capturing on" "$work/dumpcap.log" && break
  kill -0 "$dumpcap_pid" 2>/dev/null || break
  sleep 0.1
done
if ! grep -q "Capturing on" "$work/dumpcap.log"; then
  cat "$work/dumpcap.log"
  # A container without CAP_NET_RAW: root, but no capture.
  grep -qi "permi" "$work/dumpcap.log" && { echo "SKIP: not permitted to capture on lo"; exit 77; }
  echo "FAIL: dumpcap did not start"; exit 1
fi

# ---------------------------------------------------------------- traffic ---
# The checks expect each request once. A resend (the default least timeout
# is 200 us, which a loaded CI machine outwaits) adds frames, and a device
# answering a request and its copy at once sends both as one GSO train,
# which a capture on lo shows as one frame with a bad CRC.
rto=(--min-rto-us 50000)
nd() { "$cli" -d "$dev" "${rto[@]}" "$@" >>"$work/cli.log" 2>&1; }
must() { "$@" || fail "command failed: $*"; }
must nd ping
must nd -k 7 write 0x1000 --hex '01 02 03 04 05 06 07 08 de ad be ef'
must nd -k 7 read 0x1000 12
must nd -k 7 fetch-add 0x2000 0x102
must nd -k 7 fetch-add 0x2000 1
must nd -k 7 cas 0x2008 0 42
must nd -k 7 swap 0x2010 99
must nd -k 7 fill 0x3000 100 --pattern 0a0b0c
must nd -k 7 copy 0x4000 0x1000 12
"$py" -c 'import struct,sys; sys.stdout.buffer.write(struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))' >"$work/dense.f32"
"$py" -c 'import struct,sys; sys.stdout.buffer.write(struct.pack("<4f", 0.0, 10.0, 0.0, 100.0))' >"$work/sparse.f32"
must nd -k 7 reduce 0x5000 --type f32 --op sum --sparse never "$work/dense.f32"
must nd -k 7 reduce 0x6000 --type f32 --op max --sparse always "$work/sparse.f32"
# One reduction per element type, at addresses that tell them apart.
mk() { "$py" -c "import struct,sys; sys.stdout.buffer.write($1)" >"$work/$2"; }
mk 'struct.pack("<2e", 0.5, -2.0)' f16.bin
mk 'struct.pack("<2H", 0x3f80, 0xc040)' bf16.bin  # 1.0, -3.0
mk 'struct.pack("<d", 1.25)' f64.bin
mk 'struct.pack("<2i", -1, 7)' i32.bin
mk 'struct.pack("<q", -5)' i64.bin
for t in f16 bf16 f64 i32 i64; do must nd -k 7 reduce 0x7000 --type $t --op min --sparse never "$work/$t.bin"; done
must nd stats
must nd --admin-key 0xAD region add 0x8000 4KiB 0x55 --perms r
must nd --admin-key 0xAD region ls
must nd --admin-key 0xAD region del 0x55
nd -k 0x4242 read 0 8 && fail "a read with an unknown key succeeded"
must "$py" "$here/send_raw.py" "$dev" "$dev2" >>"$work/cli.log" 2>&1

np() { "$cli" -d "$proxy" "${rto[@]}" "$@" >>"$work/cli.log" 2>&1; }
head -c 8192 /dev/urandom >"$work/blob"
must np pool alloc blob 8192 --stripe 4KiB
must np pool ls
must np pool stat
must np pool put blob "$work/blob"
must np pool get blob --direct -o "$work/blob.back"
must np pool free blob

sleep 0.3
kill -INT "$dumpcap_pid"
wait "$dumpcap_pid" 2>/dev/null
[[ -s "$cap" ]] || { echo "FAIL: empty capture"; exit 1; }

# ----------------------------------------------------------------- decode ---
# Heuristics first: an ephemeral port may belong to another dissector.
ts() { tshark -X lua_script:"$lua" -o udp.try_heuristic_first:TRUE -r "$cap" "$@" 2>>"$work/tshark.log"; }
fields=(frame.number udp.srcport udp.dstport _ws.col.Info
  netdam.magic netdam.version netdam.opcode netdam.flags netdam.flags.response netdam.flags.ack_req
  netdam.flags.sparse netdam.status netdam.dtype netdam.redop netdam.seg_count netdam.depth netdam.seg_index
  netdam.rkey netdam.txn netdam.addr netdam.length netdam.boot netdam.request_in netdam.response_in
  netdam.payload.len netdam.data netdam.elem.f32 netdam.elem.f16 netdam.elem.bf16 netdam.elem.f64
  netdam.elem.i32 netdam.elem.i64 netdam.sparse.pairs netdam.sparse.index
  netdam.ping.boot_id netdam.ping.max_payload netdam.ping.memory_bytes netdam.ping.version netdam.ping.cookie
  netdam.ping.flags.pool_proxy
  netdam.stats.entries netdam.stats.name netdam.stats.value netdam.fill.pattern
  netdam.copy.src_addr netdam.copy.src_key netdam.arm.generation netdam.arm.previous
  netdam.atomic.addend netdam.atomic.expected netdam.atomic.desired netdam.atomic.new netdam.atomic.old
  netdam.opt.kind netdam.opt.step netdam.opt.lr netdam.opt.grad_scale
  netdam.agg.contributor netdam.agg.contributors netdam.agg.stride netdam.agg.generation netdam.agg.answer_flags
  netdam.region.key netdam.region.base netdam.region.size netdam.region.perms netdam.region.count
  netdam.sr.reply_ip netdam.sr.reply_port netdam.sr.generation
  netdam.seg.ip netdam.seg.port netdam.seg.opcode netdam.seg.rkey netdam.seg.aux netdam.seg.addr
  netdam.pool.name netdam.pool.size netdam.pool.stripe netdam.pool.base netdam.pool.key netdam.pool.policy
  netdam.pool.slots netdam.pool.slot.port netdam.pool.slot.flags netdam.pool.slot.rkey netdam.pool.device_count
  netdam.pool.device.port netdam.pool.device.state netdam.pool.allocations netdam.pool.records
  netdam.crc netdam.crc.computed netdam.crc.status)
args=()
for f in "${fields[@]}"; do args+=(-e "$f"); done
tsv="$work/fields.tsv"
ts -Y netdam -T fields -E header=y -E separator=/t -E occurrence=a -E aggregator=, "${args[@]}" >"$tsv"
rows=$(($(wc -l <"$tsv") - 1))
((rows >= 60)) && ok "$rows netdam frames decoded" || { cat "$work/tshark.log"; fail "only $rows netdam frames decoded"; }

# q CONDITION FIELD: FIELD of the first frame for which the awk CONDITION
# holds; f["name"] is a field of that frame.
q() {
  awk -F'\t' -v want="$2" '
    NR == 1 { for (i = 1; i <= NF; i++) col[$i] = i; next }
    { for (k in col) f[k] = $col[k] }
    ('"$1"') { print f[want]; found = 1; exit }
    END { if (!found) print "<no such frame>" }' "$tsv"
}
# check WHAT CONDITION FIELD EXPECTED
check() {
  local got
  got=$(q "$2" "$3")
  [[ "$got" == "$4" ]] && ok "$1: $3 = $4" || fail "$1: $3 is '$got', want '$4'"
}
none() {  # none WHAT CONDITION: no frame satisfies CONDITION
  local n
  n=$(q "$2" frame.number)
  [[ "$n" == "<no such frame>" ]] && ok "$1" || fail "$1: frame $n"
}
op() { echo "f[\"netdam.opcode\"] == \"$1\""; }  # op 0x11: that opcode
req='f["netdam.flags.response"] == "0"'
ans='f["netdam.flags.response"] == "1"'
dport="f[\"udp.dstport\"] == \"${dev##*:}\""
sport="f[\"udp.srcport\"] == \"${dev##*:}\""
pport="f[\"udp.dstport\"] == \"${proxy##*:}\""
psport="f[\"udp.srcport\"] == \"${proxy##*:}\""

# Header, flags, matching.
none "every frame has magic 0x4e44414d" 'f["netdam.magic"] != "0x4e44414d"'
none "every frame has version 1" 'f["netdam.version"] != "1"'
none "every answer is matched to its request by txn" "$ans && f[\"netdam.request_in\"] == \"\""
none "every answer has flags exactly RESPONSE" "$ans && f[\"netdam.flags\"] != \"0x01\""
for name in PING STATS READ WRITE FILL COPY ARM FETCH_ADD COMPARE_SWAP SWAP REDUCE_MEM OPT_CONFIG \
  OPT_STEP CHAIN REGION_ADD REGION_DEL REGION_LIST POOL_ALLOC POOL_FREE POOL_LOOKUP POOL_LIST POOL_MAP \
  POOL_STAT; do
  for kind in request answer; do
    [[ $(q "index(f[\"_ws.col.Info\"], \"$name $kind \") == 1" frame.number) != "<no such frame>" ]] ||
      fail "no frame shows as '$name $kind'"
  done
done
ok "opcode names of requests and answers in the Info column"
check "PING request" "$(op 0x01) && $req && $dport" netdam.length 0
check "PING answer" "$(op 0x01) && $ans && $sport" netdam.ping.version 1
check "PING answer" "$(op 0x01) && $ans && $sport" netdam.ping.memory_bytes 1048576
check "PING answer" "$(op 0x01) && $ans && $sport" netdam.payload.len 32
cookie=$(q "$(op 0x01) && $ans && $sport" netdam.ping.cookie)
[[ "$cookie" =~ ^0x[0-9a-f]{8}$ && "$cookie" != 0x00000000 ]] && ok "PING answer: cookie $cookie" ||
  fail "PING answer: cookie '$cookie'"
check "READ request after PING" "$(op 0x10) && $req && f[\"netdam.addr\"] == \"0x0000000000001000\"" netdam.boot "$cookie"
check "WRITE request" "$(op 0x11) && $req && $dport" netdam.flags 0x02
check "WRITE request" "$(op 0x11) && $req && $dport" netdam.flags.ack_req 1
check "WRITE request" "$(op 0x11) && $req && $dport" netdam.length 12
check "WRITE request" "$(op 0x11) && $req && $dport" netdam.data 0102030405060708deadbeef
check "WRITE request" "$(op 0x11) && $req && $dport" netdam.rkey 0x00000007
check "WRITE answer" "$(op 0x11) && $ans && $sport" netdam.flags 0x01
check "WRITE answer" "$(op 0x11) && $ans && $sport" netdam.length 0
wtxn=$(q "$(op 0x11) && $req && $dport" netdam.txn)
check "WRITE answer echoes the txn" "$(op 0x11) && $ans && $sport" netdam.txn "$wtxn"
wframe=$(q "$(op 0x11) && $req && $dport" frame.number)
check "WRITE answer names its request" "$(op 0x11) && $ans && $sport" netdam.request_in "$wframe"
check "READ answer" "$(op 0x10) && $ans && f[\"netdam.status\"] == \"0\" && $sport" netdam.data 0102030405060708deadbeef

# Atomics: little-endian operands and results.
check "FETCH_ADD request" "$(op 0x20) && $req && $dport" netdam.atomic.addend 258
check "FETCH_ADD answers" "$(op 0x20) && $ans && $sport" netdam.atomic.old 0
check "FETCH_ADD answers" "$(op 0x20) && $ans && $sport && f[\"netdam.atomic.old\"] != \"0\"" netdam.atomic.old 258
check "COMPARE_SWAP request" "$(op 0x21) && $req && $dport" netdam.atomic.desired 42
check "SWAP request" "$(op 0x22) && $req && $dport" netdam.atomic.new 99
check "FILL request" "$(op 0x12) && $req && $dport" netdam.fill.pattern 0a0b0c
check "COPY request" "$(op 0x13) && $req && $dport" netdam.copy.src_addr 0x0000000000001000

# Reductions: dense f32 elements and sparse pairs.
check "REDUCE_MEM dense" "$(op 0x30) && $req && $dport && f[\"netdam.flags.sparse\"] == \"0\"" netdam.elem.f32 1,2,3,4
check "REDUCE_MEM dense" "$(op 0x30) && $req && $dport && f[\"netdam.flags.sparse\"] == \"0\"" netdam.redop 1
check "REDUCE_MEM sparse" "$(op 0x30) && $req && $dport && f[\"netdam.flags.sparse\"] == \"1\"" netdam.sparse.index 1,3
check "REDUCE_MEM sparse" "$(op 0x30) && $req && $dport && f[\"netdam.flags.sparse\"] == \"1\"" netdam.elem.f32 10,100
check "REDUCE_MEM sparse" "$(op 0x30) && $req && $dport && f[\"netdam.flags.sparse\"] == \"1\"" netdam.length 16
typed() { echo "$(op 0x30) && $req && f[\"netdam.dtype\"] == \"$1\""; }
check "REDUCE_MEM f16" "$(typed 2)" netdam.elem.f16 0.5,-2
check "REDUCE_MEM bf16" "$(typed 3)" netdam.elem.bf16 1,-3
check "REDUCE_MEM f64" "$(typed 4)" netdam.elem.f64 1.25
check "REDUCE_MEM i32" "$(typed 5)" netdam.elem.i32 -1,7
check "REDUCE_MEM i64" "$(typed 6)" netdam.elem.i64 -5
check "REDUCE_MEM i64" "$(typed 6)" netdam.redop 2

# STATS, regions.
names=$(q "$(op 0x02) && $ans && f[\"netdam.addr\"] == \"0x0000000000000000\"" netdam.stats.name)
[[ ",$names," == *,rx_packets,* && ",$names," == *,drop.bad_crc,* && ",$names," == *,op.FETCH_ADD,* ]] && ok "STATS answer: entry names" ||
  fail "STATS answer names: $names"
check "REGION_ADD request" "$(op 0x50) && $req" netdam.region.key 0x00000055
check "REGION_ADD request" "$(op 0x50) && $req" netdam.region.perms 0x00000001
check "REGION_ADD request" "$(op 0x50) && $req" netdam.region.size 4096
check "REGION_LIST answer" "$(op 0x52) && $ans && f[\"netdam.region.count\"] != \"0\"" netdam.region.count 4
check "REGION_DEL request" "$(op 0x51) && $req" netdam.region.key 0x00000055

# A NAK, by number and by name.
check "NAK" "$(op 0x10) && $ans && f[\"netdam.rkey\"] == \"0x00004242\"" netdam.status 6
bad_key=$(ts -Y 'netdam.status == "BAD_KEY" && netdam.opcode == "READ"' -T fields -e netdam.rkey)
[[ "$bad_key" == 0x00004242 ]] && ok "filter netdam.status == \"BAD_KEY\"" || fail "BAD_KEY filter gave '$bad_key'"
info=$(q "$(op 0x10) && $ans && f[\"netdam.rkey\"] == \"0x00004242\"" _ws.col.Info)
[[ "$info" == "READ answer txn="*" NAK BAD_KEY" ]] && ok "NAK info: $info" || fail "NAK info: '$info'"

# send_raw.py: ARM, chains, optimizer, aggregation.
check "ARM request" "$(op 0x14) && $req" netdam.arm.generation 5
check "ARM answer" "$(op 0x14) && $ans" netdam.arm.previous 0
chain="$(op 0x40) && $req && f[\"netdam.seg_count\"] == \"2\""
check "CHAIN request" "$chain" netdam.seg.opcode 0x31,0x11
check "CHAIN request" "$chain" netdam.seg.addr 0x0000000000010100,0x0000000000010200
check "CHAIN request" "$chain" netdam.seg.rkey 0x00000009,0x00000009
check "CHAIN request" "$chain" netdam.seg.port "${dev##*:},${dev2##*:}"
check "CHAIN request" "$chain" netdam.seg.ip 127.0.0.1,127.0.0.1
check "CHAIN request" "$chain" netdam.sr.reply_ip 0.0.0.0
check "CHAIN request" "$chain" netdam.elem.f32 0.5,0.25
check "CHAIN request" "$chain" netdam.dtype 1
fwd="$(op 0x40) && $req && f[\"netdam.seg_index\"] == \"1\""
check "CHAIN forwarded" "$fwd" netdam.sr.reply_ip 127.0.0.1
check "CHAIN forwarded" "$fwd" netdam.sr.reply_port "$(q "$chain" udp.srcport)"
check "CHAIN forwarded" "$fwd" udp.dstport "${dev2##*:}"
check "CHAIN forwarded" "$fwd" netdam.elem.f32 0.5,0.25
ctxn=$(q "$chain" netdam.txn)
check "CHAIN answer" "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" netdam.seg_index 1
check "CHAIN answer" "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" udp.srcport "${dev2##*:}"
check "CHAIN answer names its request" "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" \
  netdam.request_in "$(q "$chain" frame.number)"
# An answer's byte 10 is the last hop's queue depth, not a segment count.
check "CHAIN answer" "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" netdam.seg_count ""
depth=$(q "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" netdam.depth)
[[ "$depth" =~ ^[0-9]+$ && "$depth" -le 255 ]] && ok "CHAIN answer: netdam.depth = $depth" ||
  fail "CHAIN answer: netdam.depth is '$depth', want 0..255"
check "READ chain answer" "$(op 0x40) && $ans && f[\"netdam.length\"] == \"8\"" netdam.data 0000003f0000803e
check "OPT_CONFIG request" "$(op 0x33) && $req" netdam.opt.kind 1
check "OPT_CONFIG request" "$(op 0x33) && $req" netdam.opt.lr 0.5
check "OPT_CONFIG request" "$(op 0x33) && $req" netdam.opt.step 1
check "OPT_STEP request" "$(op 0x34) && $req" netdam.elem.f32 2
agg="$(op 0x40) && $req && f[\"netdam.seg.opcode\"] == \"0x35\""
check "AGGREGATE request" "$agg" netdam.agg.contributors 1
check "AGGREGATE request" "$agg" netdam.agg.stride 512
check "AGGREGATE request" "$agg" netdam.seg.aux 0x00000002
check "AGGREGATE request" "$agg" netdam.sr.generation 7
check "AGGREGATE request" "$agg" netdam.elem.f32 1.5
check "AGGREGATE answer" "$(op 0x40) && $ans && f[\"netdam.agg.generation\"] != \"\"" netdam.agg.generation 7
check "AGGREGATE answer" "$(op 0x40) && $ans && f[\"netdam.agg.generation\"] != \"\"" netdam.elem.f32 1.5

# The integrity trailer: every datagram good but the one sent bad.
check "CRC good on all but one" "f[\"netdam.crc.status\"] != \"1\"" netdam.txn 195936478
check "bad CRC" 'f["netdam.txn"] == "195936478"' netdam.crc.status 0
computed=$(q 'f["netdam.txn"] == "195936478"' netdam.crc.computed)
sent=$(q 'f["netdam.txn"] == "195936478"' netdam.crc)
[[ $((computed ^ sent)) == 1 ]] && ok "bad CRC: sent $sent, computed $computed" ||
  fail "bad CRC: sent $sent, computed $computed"
expert=$(ts -Y 'netdam.crc.bad' -T fields -e netdam.txn)
[[ "$expert" == 195936478 ]] && ok "expert info netdam.crc.bad on the bad datagram only" ||
  fail "expert netdam.crc.bad on '$expert'"
none "bad CRC not answered" "$(op 0x01) && $ans && f[\"netdam.txn\"] == \"195936478\""

# The pool proxy (section 17).
check "POOL_ALLOC request" "$(op 0x60) && $req" netdam.pool.name blob
check "POOL_ALLOC request" "$(op 0x60) && $req" netdam.pool.size 8192
check "POOL_ALLOC request" "$(op 0x60) && $req" netdam.pool.stripe 4096
check "POOL_ALLOC answer" "$(op 0x60) && $ans" netdam.pool.base 0x0000010000000000
check "POOL_ALLOC answer" "$(op 0x60) && $ans" netdam.pool.name blob
check "POOL_LIST answer" "$(op 0x63) && $ans && f[\"netdam.pool.records\"] != \"0\"" netdam.pool.key 0x0000000000000000
check "PING answer of the proxy" "$(op 0x01) && $ans && $psport" netdam.ping.flags.pool_proxy 1
check "PING answer of a device" "$(op 0x01) && $ans && $sport" netdam.ping.flags.pool_proxy 0
akey=$(q "$(op 0x60) && $ans" netdam.pool.key)
[[ "$akey" =~ ^0x[0-9a-f]{16}$ && "${akey:2:8}" != 00000000 ]] && ok "POOL_ALLOC answer: 64-bit key $akey" ||
  fail "POOL_ALLOC answer: key '$akey'"
[[ $(q "$(op 0x64) && $req" netdam.boot) == "0x${akey:2:8}" ]] && ok "POOL_MAP request: boot is the key's high half" ||
  fail "POOL_MAP request: boot '$(q "$(op 0x64) && $req" netdam.boot)', key $akey"
skey=$(q "$(op 0x64) && $ans" netdam.pool.slot.rkey)
[[ "$skey" =~ ^0x[0-9a-f]{8}$ && "$skey" != "0x${akey:10:8}" ]] && ok "POOL_MAP answer: device key $skey" ||
  fail "POOL_MAP answer: device key '$skey' (allocation key $akey)"
check "POOL_STAT answer" "$(op 0x65) && $ans" netdam.pool.device_count 1
check "POOL_STAT answer" "$(op 0x65) && $ans" netdam.pool.device.port "${dev##*:}"
check "POOL_STAT answer" "$(op 0x65) && $ans" netdam.pool.device.state 0
check "POOL_MAP answer" "$(op 0x64) && $ans" netdam.pool.slots 1
check "POOL_MAP answer" "$(op 0x64) && $ans" netdam.pool.slot.port "${dev##*:}"
check "POOL_MAP answer" "$(op 0x64) && $ans" netdam.pool.slot.flags 0x01
check "POOL_FREE request" "$(op 0x61) && $req && $pport" netdam.pool.name blob
cmp -s "$work/blob" "$work/blob.back" && ok "pool data round trip" || fail "pool data differs"

# With two passes (-2) a request names its answer too.
pair=$(ts -2 -Y "netdam.txn == $ctxn && netdam.seg_index == 0 && netdam.flags.response == 0" -T fields -e netdam.response_in)
want=$(q "$(op 0x40) && $ans && f[\"netdam.txn\"] == \"$ctxn\"" frame.number)
[[ "$pair" == "$want" ]] && ok "tshark -2: CHAIN request names its answer, frame $want" ||
  fail "tshark -2: CHAIN request's answer is '$pair', want '$want'"

# The tree: names as a reader sees them.
ts -V -Y "netdam.opcode == 0x20 && netdam.flags.response == 1" -c 400 >"$work/verbose.txt"
for line in "Opcode: FETCH_ADD (0x20)" "RESPONSE: True" "Status: OK (0)" "Previous value: 0" \
  "CRC32C status: Good (1)"; do
  grep -qF "$line" "$work/verbose.txt" && ok "tshark -V shows '$line'" || fail "tshark -V lacks '$line'"
done

if ((failures)); then
  echo "--- cli ---"; cat "$work/cli.log"; echo "--- tshark ---"; cat "$work/tshark.log"
  echo "FAILED: $failures check(s)"; exit 1
fi
echo "all checks passed"
