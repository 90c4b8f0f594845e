#!/usr/bin/env bash
# The main job: set everything up, start a local netdam device and do real
# work with it over UDP, measure it against the raw UDP ceiling, run verified
# AllReduce on a local cluster of 4 devices, and show a memory pool: devices
# behind an address-translating proxy, used by a plain UDP client.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# NETDAM_BENCH explicitly: a build dir configured by scripts/test.sh has it off.
BUILD_DIR=build bash scripts/build.sh -DNETDAM_BENCH=ON

bin=build/src
work=$(mktemp -d)
shm="netdam-demo-$$"
cleanup() {
  [[ -n "${dev_pid:-}" ]] && kill "$dev_pid" 2>/dev/null && wait "$dev_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "start a device: 64 MiB of memory, also mapped at /dev/shm/$shm for its host"
"$bin/daemon/netdamd" --listen 127.0.0.1:0 --port-file "$work/port" --memory 64MiB \
  --shm "$shm" --admin-key 0xAD &
dev_pid=$!
for _ in $(seq 100); do [[ -s "$work/port" ]] && break; sleep 0.05; done
export NETDAM_DEVICE=$(cat "$work/port")
netdam() { "$bin/tools/netdam" "$@"; }

step "ping $NETDAM_DEVICE"
netdam ping

step "write 100 KB of random bytes (13 packets), read them back, compare"
head -c 100000 /dev/urandom > "$work/in"
netdam write 0x10000 "$work/in"
netdam read 0x10000 100000 --raw > "$work/out"
cmp "$work/in" "$work/out" && echo "read back 100000 bytes: identical"

step "hexdump of the first 64 bytes"
netdam read 0x10000 64

step "a fetch-add sequencer: five tickets"
for i in 1 2 3 4 5; do echo "ticket $(netdam fetch-add 0x100 1)"; done

step "SIMD reduction into device memory: 2048 float32 (one jumbo packet), memory += x three times"
perl -e 'print pack("f<*", map { $_ * 0.5 } 0..2047)' > "$work/x.f32"
netdam fill 0x200000 8192 --byte 0
for _ in 1 2 3; do netdam reduce 0x200000 --type f32 --op sum "$work/x.f32"; done
netdam read 0x200000 8192 --raw > "$work/sum.f32"
perl -e 'local $/; my @v = unpack("f<*", <STDIN>); my $bad = grep { $v[$_] != 1.5 * $_ } 0..$#v;
         printf "element 0..3: %s ... element 2047: %s; %d of %d elements wrong\n",
                join(", ", @v[0..3]), $v[2047], $bad, scalar @v; exit($bad ? 1 : 0)' < "$work/sum.f32"

step "regions: add a read-only region, and see a write into it refused"
netdam --admin-key 0xAD region add 0x3000000 1MiB 0x77 --perms r
netdam --admin-key 0xAD region ls
if echo "nope" | netdam --key 0x77 write 0x3000000; then echo "unexpected: write accepted"; exit 1; fi

step "device counters"
netdam stats

step "READ/WRITE latency and throughput vs the raw UDP ceiling (same run)"
build/bench/netdam-bench rw --device "$NETDAM_DEVICE" --sizes 64,8KiB,64KiB --iters 2000 || true

# --algo aggregate: on one host the group would otherwise meet in shared
# memory up to 1 MiB (docs/COLLECTIVES.md 13), and the devices would not
# be in the path this demo is about.
step "a local cluster of 4 devices: AllReduce inside the network (the devices aggregate), every result verified"
build/bench/netdam-bench allreduce --local 4 --algo aggregate -b 8 -e 4M -f 8 --time-per-size 0.5

step "the same under 1% loss, 1% duplication and 1% reordering injected at the devices: results stay exact"
build/bench/netdam-bench allreduce --local 4 --algo aggregate -b 1K -e 1M -f 32 --time-per-size 0.5 \
  --drop 0.01 --dup 0.01 --reorder 0.01

step "the same 4 ranks as one host's: small AllReduces meet in shared memory, no device involved"
build/bench/netdam-bench allreduce --local 4 -b 8 -e 1M -f 32 --time-per-size 0.5

step "a memory pool: 3 devices behind one address-translating proxy (netdam-mmu), state in SQLite"
pool_pids=()
for i in 0 1 2; do
  "$bin/daemon/netdamd" --listen 127.0.0.1:0 --port-file "$work/pool$i.port" --memory 16MiB \
    --admin-key 0xAD --no-default-region &
  pool_pids+=($!)
done
for i in 0 1 2; do for _ in $(seq 100); do [[ -s "$work/pool$i.port" ]] && break; sleep 0.05; done; done
"$bin/mmu/netdam-mmu" --listen 127.0.0.1:0 --port-file "$work/mmu.port" --device-admin-key 0xAD --admin-key 0xB0 \
  --state "$work/pool.sqlite" --log-level warn \
  --device "$(cat "$work/pool0.port")" --device "$(cat "$work/pool1.port")" --device "$(cat "$work/pool2.port")" &
pool_pids+=($!)
trap 'kill "${pool_pids[@]}" 2>/dev/null || true; cleanup' EXIT
for _ in $(seq 100); do [[ -s "$work/mmu.port" ]] && break; sleep 0.05; done
proxy=$(cat "$work/mmu.port")
netdam -d "$proxy" --admin-key 0xB0 pool alloc demo 1MiB --stripe 4KiB | tee "$work/alloc"
base=$(grep -o 'base=0x[0-9a-f]*' "$work/alloc" | cut -d= -f2)
key=$(grep -o 'key=0x[0-9a-f]*' "$work/alloc" | cut -d= -f2)

step "a plain UDP client (scripts/pool_client.py: a socket and docs/PROTOCOL.md) writes 200 KB at the allocation's global address through the proxy and reads it back"
head -c 200000 /dev/urandom > "$work/blob"
/usr/bin/python3 scripts/pool_client.py "$proxy" "$base" "$key" "$work/blob"

step "the same bytes read directly from the 3 devices (the client fetches the translation table), and where they landed"
netdam -d "$proxy" --admin-key 0xB0 pool get demo --length 200000 --direct | cmp - "$work/blob" && echo "direct read: identical"
netdam -d "$proxy" --admin-key 0xB0 pool stat

step "PyTorch: DDP on 4 ranks over the netdam torch.distributed backend, Adam offloaded to the devices (netdam.optim): the devices hold the weights and Adam's state, and every rank's gradients are averaged in the network on their way to them"
# The ranks start devices of their own (NETDAM_DEVICE above names the first demo device).
env -u NETDAM_DEVICE PYTHONPATH=build/python /usr/bin/python3 examples/ddp_train.py --backend netdam \
  --optimizer offload-adam --steps 10

step "done"
