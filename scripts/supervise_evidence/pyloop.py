"""The Python floor for one stopped call: the least a supervisor in Python does (poll, recv, CONTINUE) over a child
that calls os.stat("/") 100,000 times under ogrefs.supervise's filter. Evidence for docs/mount.md, not shipped.
Prints the child's µs per call and the supervisor's own CPU µs per call. Usage: python pyloop.py [sync]"""

import os
import select
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
from ogrefs.supervise import seccomp  # noqa: E402

N = 100_000
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
pid = os.fork()
if pid == 0:
    fd = seccomp.install(seccomp.this_arch())
    socket.send_fds(theirs, [b"ok"], [fd])
    os.close(fd)
    t = time.perf_counter()
    for _ in range(N):
        os.stat("/")
    print(f"python loop{' sync' if sys.argv[1:] else ''}: {(time.perf_counter() - t) / N * 1e6:.2f} µs a call",
          end="", flush=True)
    os._exit(0)
_msg, fds, _flags, _addr = socket.recv_fds(ours, 10, 1)
listener = seccomp.Listener(fds[0])
if sys.argv[1:]:
    listener.sync_wake_up()
poller = select.poll()
poller.register(listener.fd, select.POLLIN)
before, calls = os.times(), 0
while True:
    events = poller.poll(200)
    if not events or not events[0][1] & select.POLLIN:
        if os.waitpid(pid, os.WNOHANG)[0]:
            break
        continue
    listener.pass_next()
    calls += 1
after = os.times()
cpu = after.user + after.system - before.user - before.system
print(f", supervisor's own CPU {cpu / max(calls, 1) * 1e6:.2f} µs a call ({calls} calls)")
