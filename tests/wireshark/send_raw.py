"""Sends the netdam requests the CLI cannot make, for tests/wireshark/wireshark_test.sh.

Usage: send_raw.py HOST:PORT HOST2:PORT2

Both devices must have region 9 (at 64 KiB), the first also region 10 (at
128 KiB), 64 KiB each, read-write, chains allowed, and share a cookie secret. Plain UDP and docs/PROTOCOL.md only, so the
capture holds bytes built by a second, independent encoder. Sends, in order:
a PING (for the cookie), ARM, a chain over both devices (REDUCE_PAYLOAD at
the first > WRITE at the second), a one-segment READ chain at the second, OPT_CONFIG and OPT_STEP, an AGGREGATE of one
contributor, and a PING whose CRC32C trailer is wrong (txn 0xBADC0DE), which
the device drops. Exits non-zero if an answer is missing or not OK.
"""
import socket
import struct
import sys
import time

HDR = struct.Struct('>IBBBBBBBBIQQII')
MAGIC, RESPONSE = 0x4E44414D, 0x01
PING, READ, WRITE, ARM, REDUCE_PAYLOAD = 0x01, 0x10, 0x11, 0x14, 0x31
OPT_CONFIG, OPT_STEP, AGGREGATE, CHAIN = 0x33, 0x34, 0x35, 0x40
F32, SUM = 1, 1
BAD_TXN = 0xBADC0DE

T = [0] * 256
for i in range(256):
    c = i
    for _ in range(8):
        c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    T[i] = c


def crc32c(b):
    c = 0xFFFFFFFF
    for x in b:
        c = T[(c ^ x) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def endpoint(text):
    host, port = text.rsplit(':', 1)
    return host, int(port)


dev, dev2 = endpoint(sys.argv[1]), endpoint(sys.argv[2])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.settimeout(0.2)
txn = time.time_ns()
boot = 0


def seal(pkt):
    return pkt + struct.pack('>I', crc32c(pkt))


def segment(at, op, rkey, addr, flags=0, aux=0):
    return socket.inet_aton(at[0]) + struct.pack('>HBBIIQ', at[1], op, flags, rkey, aux, addr)


def send(op, payload=b'', to=dev, rkey=0, addr=0, length=None, dtype=0, redop=0, segs=(),
         generation=0, expect_answer=True):
    global txn
    txn += 1
    if length is None:
        length = len(payload)
    routing = b''
    if segs:
        routing = struct.pack('>IHHII', 0, 0, 0, generation, 0) + b''.join(segs)
    pkt = seal(HDR.pack(MAGIC, 1, op, 0, 0, dtype, redop, len(segs), 0, rkey, txn, addr, length,
                        boot) + routing + payload)
    for _ in range(10):
        sock.sendto(pkt, to)
        try:
            while True:
                data, _src = sock.recvfrom(65536)
                if struct.unpack('>I', data[-4:])[0] != crc32c(data[:-4]):
                    continue
                h = HDR.unpack_from(data)
                if h[0] == MAGIC and h[3] & RESPONSE and h[10] == txn:
                    if h[4] != 0:
                        sys.exit(f'opcode {op:#x}: NAK status {h[4]}')
                    return data[HDR.size:-4]
        except socket.timeout:
            continue
    sys.exit(f'opcode {op:#x}: no answer')


info = send(PING)
boot = struct.unpack_from('>I', info, 28)[0] or struct.unpack_from('>I', info, 0)[0]

send(ARM, struct.pack('>I', 5), rkey=9)
# f32 [0.5, 0.25] + the first device's memory (zero) at 0x10100, stored at
# 0x10200 of the second: the first forwards, the second answers.
send(CHAIN, struct.pack('<2f', 0.5, 0.25), dtype=F32, redop=SUM,
     segs=(segment(dev, REDUCE_PAYLOAD, 9, 0x10100), segment(dev2, WRITE, 9, 0x10200)))
# Reads the stored pair back: the answer's opcode is CHAIN, its payload READ
# data. A READ chain needs the cookie (PROTOCOL.md 9.6): the test starts
# both devices with one --cookie-secret, so the first's cookie is valid here.
send(CHAIN, to=dev2, length=8, segs=(segment(dev2, READ, 9, 0x10200),))

# SGD, step 1, lr 0.5, grad_scale 1: the parameter at 0x10300 goes 0 -> -1.0.
opt = struct.pack('>BB6xQdddddd', 1, 0, 1, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0) + struct.pack('>QQ', 0, 0)
send(OPT_CONFIG, opt, rkey=9)
send(OPT_STEP, struct.pack('<f', 2.0), rkey=9, addr=0x10300, dtype=F32)

# One contributor of one: the block completes at once; generation 7, block 2.
record = struct.pack('>HHIII', 0, 1, 512, 0, 0)
send(CHAIN, record + struct.pack('<f', 1.5), length=4, dtype=F32, redop=SUM, generation=7,
     segs=(segment(dev, AGGREGATE, 10, 0, aux=2),))

# A PING with a wrong trailer: dropped by the device, shown as bad.
bad = HDR.pack(MAGIC, 1, PING, 0, 0, 0, 0, 0, 0, 0, BAD_TXN, 0, 0, 0)
sock.sendto(bad + struct.pack('>I', crc32c(bad) ^ 0x1), dev)
print('sent')
