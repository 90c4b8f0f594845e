#!/usr/bin/env python3
"""Issue 12, attack 5, against a real netdamd: RSS before and after N keyless
datagrams from S source addresses (127.0.0.2.. x ports), half FETCH_ADDs and
half REDUCE_MEM chains, all with txn 2^64-1 and keys no region has.

    scripts/keyless_flood.py build/src/daemon/netdamd [N=1000000] [S=100000]

Prints the device's RSS (VmRSS) idle, after the flood, and its STATS
replay/refusal counters as the netdam CLI would show them."""
import os, socket, struct, subprocess, sys, tempfile, time

HDR = struct.Struct('>IBBBBBBBBIQQII')
MAGIC, FETCH_ADD, CHAIN, REDUCE_MEM = 0x4E44414D, 0x20, 0x40, 0x30
TXN = (1 << 64) - 1


def rss_kib(pid):
    with open(f'/proc/{pid}/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1])
    return 0


def main():
    netdamd = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    sources = int(sys.argv[3]) if len(sys.argv) > 3 else 100_000
    port_file = tempfile.mktemp()
    dev = subprocess.Popen([netdamd, '--listen', '127.0.0.1:0', '--port-file', port_file,
                            '--memory', '64MiB', '--log-level', 'warn'])
    try:
        for _ in range(100):
            if os.path.exists(port_file):
                break
            time.sleep(0.05)
        host, port = open(port_file).read().strip().rsplit(':', 1)
        to = (host, int(port))
        time.sleep(0.3)
        idle = rss_kib(dev.pid)
        fa = HDR.pack(MAGIC, 1, FETCH_ADD, 0, 0, 0, 0, 0, 0, 0x5EC, TXN, 0x100, 8, 0) + struct.pack('<Q', 1)
        head = HDR.pack(MAGIC, 1, CHAIN, 0, 0, 6, 1, 1, 0, 0, TXN, 0, 8, 0)
        sr = struct.pack('>IHHII', 0, 0, 0, 0, 0)
        seg = struct.pack('>IHBBIIQ', 0x7F000001, int(port), REDUCE_MEM, 0, 0x5EC, 0, 0x200)
        chain = head + sr + seg + struct.pack('<q', 1)
        per = max(1, n // sources)
        sent = 0
        t0 = time.time()
        ports_per_ip = 25_000
        for s in range(sources):
            ip = f'127.0.0.{2 + s // ports_per_ip}'
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.bind((ip, 20000 + s % ports_per_ip))
            except OSError:
                sock.close()
                continue
            for i in range(per):
                sock.sendto(chain if (sent + i) % 2 else fa, to)
            sent += per
            sock.close()
            if s % 2000 == 0:
                time.sleep(0.002)  # let the device drain its socket
        time.sleep(1.0)
        after = rss_kib(dev.pid)
        print(f'sent {sent} keyless datagrams from {sources} sources in {time.time() - t0:.1f} s')
        print(f'netdamd RSS idle {idle} KiB, after {after} KiB, grew {after - idle} KiB')
        cli = os.path.join(os.path.dirname(os.path.abspath(netdamd)), '..', 'tools', 'netdam')
        if os.path.exists(cli):  # what the device saw (the kernel may drop some of the flood)
            out = subprocess.run([cli, '--device', f'{host}:{port}', 'stats'], capture_output=True, text=True).stdout
            for line in out.splitlines():
                if any(line.split()[:1] == [k] for k in ('rx_packets', 'naks', 'replay.requesters', 'replay.bytes',
                                                         'refusals.sent', 'refusals.suppressed', 'nak.BAD_KEY')):
                    print('  ' + line)
    finally:
        dev.terminate()
        dev.wait()
        os.unlink(port_file)


if __name__ == '__main__':
    main()
