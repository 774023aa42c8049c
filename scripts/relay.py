#!/usr/bin/env python3
"""A TCP relay that adds a fixed one-way delay, for a benchmark link with latency.

    relay.py LISTEN_HOST:PORT TARGET_HOST:PORT --delay-ms 15

This kernel has no netem (and no fq qdisc), and tbf shapes rate only, so the
round trip of a far store is made here in user space: every byte that
arrives in either direction is released ``--delay-ms`` after it arrived, so
a request/response pair sees twice the delay (15 ms each way = 30 ms RTT).
Bytes keep their order and nothing is dropped or coalesced across the delay:
the relay adds latency, not loss, and leaves the rate to tbf.

Threads and ownership: the accept loop owns the listening socket. Each
accepted connection gets two pumps (one per direction); each pump is a reader
thread that stamps what it receives and appends it to its own deque, and a
writer thread that is the only one to pop from that deque, sleeps until the
stamp plus the delay and sends. A condition variable per pump guards its
deque. A pump ends when its reader sees EOF (the writer then half-closes the
peer after draining), or on any socket error (both sockets are closed).

Runs until killed; the benchmark starts it inside the store's network
namespace (scripts/netlab.py) and kills it on exit.
"""

from __future__ import annotations

import argparse
import collections
import socket
import sys
import threading
import time

READ_BYTES = 1 << 20


class Pump:
    """One direction of one connection: src -> (delay) -> dst."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay: float) -> None:
        self.src, self.dst, self.delay = src, dst, delay
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.cond = threading.Condition()
        self.eof = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(READ_BYTES):
                with self.cond:
                    self.queue.append((time.monotonic(), data))
                    self.cond.notify()
        except OSError:
            pass
        with self.cond:
            self.eof = True
            self.cond.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.eof:
                        self.cond.wait()
                    if not self.queue:
                        break
                    stamp, data = self.queue.popleft()
                wait = stamp + self.delay - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (self.src, self.dst):
                try:
                    s.close()
                except OSError:
                    pass


def parse_addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"relay: not HOST:PORT: {text!r}")
    return host, int(port)


def serve(listen: tuple[str, int], target: tuple[str, int], delay: float) -> None:
    lsock = socket.create_server(listen, reuse_port=False, backlog=128)
    print(f"relay {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}, {delay * 1e3:.1f} ms each way", flush=True)
    while True:
        client, _ = lsock.accept()
        try:
            upstream = socket.create_connection(target, timeout=10)
            upstream.settimeout(None)
        except OSError:
            client.close()
            continue
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        Pump(client, upstream, delay).start()
        Pump(upstream, client, delay).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("listen")
    ap.add_argument("target")
    ap.add_argument("--delay-ms", type=float, required=True, help="one-way delay (half the round trip)")
    args = ap.parse_args()
    try:
        serve(parse_addr(args.listen), parse_addr(args.target), args.delay_ms / 1e3)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
