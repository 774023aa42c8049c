"""A process killed with SIGKILL right before its k-th visible step (test-only: nothing in ogrefs knows of it).

Used where a promise must hold at every kill point (``finalize``, its top-level files): the test runs
the command through :data:`KILLER` once to count the steps, then once per step, killed before it.
"""

#: ``python KILLER finalize /`` (ogrefs' CLI) or ``python KILLER -c CODE``: with every step another process
#: could see counted into $KILL_LOG (each mount(2), umount2(2) and move_mount(2) of mountsys, each
#: os.replace, each signal sent), and a SIGKILL of itself right before step $KILL_AT (0: none).
#: $KILL_NO_BENEATH: as if the kernel had no MOVE_MOUNT_BENEATH; $KILL_BENEATH_REFUSED: as if it refused each.
KILLER = r'''
import os, signal, sys
from ogrefs.box import mountsys

AT, LOG, ME = int(os.environ["KILL_AT"]), os.environ["KILL_LOG"], os.getpid()
done = 0


def step(what):
    global done
    done += 1
    with open(LOG, "a") as fh:
        fh.write(f"{done} {what}\n")
    if done == AT:
        os.kill(ME, signal.SIGKILL)


class Counted:
    """mountsys' libc, its mount, umount2 and move_mount counted (open_tree only copies: not a step)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        fn = getattr(self._real, name)
        if name not in ("mount", "umount2", "syscall"):
            return fn

        def call(*args):
            if name != "syscall" or args[0] == mountsys.SYS_MOVE_MOUNT:
                step(f"{name} {args[1] if name == 'mount' else args[0]!r}")
            return fn(*args)
        return call


mountsys._libc = Counted(mountsys._libc)
if os.environ.get("KILL_NO_BENEATH"):  # as on a kernel before Linux 6.5
    mountsys.can_mount_beneath = lambda: False
if os.environ.get("KILL_BENEATH_REFUSED"):  # as where the kernel refuses it (EINVAL: propagation)
    def refused(source, target):
        raise OSError(22, "move_mount beneath: Invalid argument")
    mountsys.move_beneath = refused
real_replace, real_kill = os.replace, os.kill


def replace(src, dst, *args, **kwargs):
    step(f"replace {dst}")
    return real_replace(src, dst, *args, **kwargs)


def kill(pid, sig):
    if pid != ME:
        step(f"kill {pid}")
    return real_kill(pid, sig)


os.replace, os.kill = replace, kill
if sys.argv[1:2] == ["-c"]:
    exec(sys.argv[2])
else:
    from ogrefs.cli.entry import main
    sys.argv[0] = "ogrefs"
    main()
'''
