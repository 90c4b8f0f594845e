#!/usr/bin/env python3
"""One TCP stream for a fixed time; the receiver prints what it measured.

  tcp_rate.py recv IP PORT [READY_FILE]   accept one connection, read to EOF,
                                          print "<bytes> <seconds> <bits/s>"
  tcp_rate.py send IP PORT SECONDS        connect and send for SECONDS

The receiver's clock runs from the first byte to EOF. Used by
tests/cluster/cluster_test.sh to check that a link's rate limit holds.
"""
import socket
import sys
import time


def recv(ip, port, ready=None):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((ip, port))
    srv.listen(1)
    if ready:
        with open(ready, "w") as f:
            f.write("ready\n")
    srv.settimeout(20)
    conn, _ = srv.accept()
    conn.settimeout(20)
    buf = bytearray(1 << 20)
    total, t0 = 0, None
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        if t0 is None:
            t0 = time.monotonic()
        total += n
    dt = time.monotonic() - t0 if t0 else 0.0
    print(f"{total} {dt:.4f} {total * 8 / dt if dt > 0 else 0:.0f}")


def send(ip, port, seconds):
    s = None
    for _ in range(100):  # the receiver may not be listening yet
        try:
            s = socket.create_connection((ip, port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    if s is None:
        sys.exit("tcp_rate: cannot connect")
    chunk = b"\0" * (1 << 18)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(chunk)
    s.close()


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "recv":
        recv(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif len(sys.argv) == 5 and sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit(__doc__)
