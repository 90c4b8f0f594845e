#!/usr/bin/python3
"""A plain UDP client of a netdam pool proxy: nothing but a socket and
docs/PROTOCOL.md. Writes FILE at a global address with WRITE+ACK_REQ
packets, reads it back with READ packets, and checks the bytes.

    pool_client.py PROXY_HOST:PORT GLOBAL_ADDR KEY FILE
"""
import os
import socket
import struct
import sys

MAGIC, VERSION = 0x4E44414D, 1
READ, WRITE, ACK_REQ = 0x10, 0x11, 0x02
HEADER = struct.Struct(">IBBBBBBBBIQQII")  # section 3.1, 40 bytes, big-endian
CHUNK = 8192  # the proxy's default max payload (PING tells it; kept simple)


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


CRC32C_TABLE = _crc32c_table()


def crc32c(data):
    """CRC32C (Castagnoli) of bytes, as the integrity trailer needs it."""
    c = 0xFFFFFFFF
    for b in data:
        c = CRC32C_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def seal(datagram):
    """Appends the integrity trailer (section 3.5): CRC32C of all bytes, big-endian."""
    return datagram + struct.pack(">I", crc32c(datagram))


def unseal(datagram):
    """The datagram without its trailer, or None if the trailer does not match."""
    if len(datagram) < 4 or struct.unpack(">I", datagram[-4:])[0] != crc32c(datagram[:-4]):
        return None
    return datagram[:-4]


def request(sock, peer, txn, opcode, flags, key, addr, length, payload=b""):
    # A pool proxy's keys are 64-bit: the low half in rkey, the high half
    # in boot (PROTOCOL.md 17).
    rkey, boot = key & 0xFFFFFFFF, key >> 32
    datagram = seal(HEADER.pack(MAGIC, VERSION, opcode, flags, 0, 0, 0, 0, 0, rkey, txn, addr, length, boot) + payload)
    for _ in range(20):  # retransmit the same txn on timeout (section 9.3)
        sock.sendto(datagram, peer)
        try:
            while True:
                answer, _ = sock.recvfrom(65536)
                answer = unseal(answer)
                if answer is None or len(answer) < HEADER.size:
                    continue  # corrupted on the way: as if lost
                h = HEADER.unpack_from(answer)
                if h[0] == MAGIC and h[10] == txn and h[3] & 0x01:
                    if h[4] != 0:
                        sys.exit(f"txn {txn}: refused with status {h[4]} (docs/PROTOCOL.md section 7)")
                    return answer[HEADER.size:]
        except socket.timeout:
            continue
    sys.exit(f"txn {txn}: no answer from {peer}")


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    peer, base, key = (host, int(port)), int(sys.argv[2], 0), int(sys.argv[3], 0)
    data = open(sys.argv[4], "rb").read()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.2)
    txn = int.from_bytes(os.urandom(6), "big") << 16
    for off in range(0, len(data), CHUNK):
        txn += 1
        request(sock, peer, txn, WRITE, ACK_REQ, key, base + off, len(data[off:off + CHUNK]), data[off:off + CHUNK])
    back = bytearray()
    for off in range(0, len(data), CHUNK):
        txn += 1
        back += request(sock, peer, txn, READ, 0, key, base + off, min(CHUNK, len(data) - off))
    print(f"wrote {len(data)} bytes at {base:#x} in {(len(data) + CHUNK - 1) // CHUNK} WRITE packets, "
          f"read them back: {'identical' if back == data else 'DIFFERENT'}")
    sys.exit(0 if back == data else 1)


if __name__ == "__main__":
    main()
