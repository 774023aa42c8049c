"""Host-owned paths: what always comes from the box a snapshot is mounted on, not from the snapshot.

A snapshot of box A mounted at ``/`` on box B must not take B's identity,
network, disks, logins or GPU driver (docs/mount.md, "Host-owned paths").
Each rule is ``KIND PATTERN`` (a glob per path component, absolute)::

    host         the entry is B's: the FUSE view omits the snapshot's, and
                 since each overlay has B's original directory as its lowest
                 layer, B's own entry shows through (or none, if B has none)
    prefer-host  a directory: B's entries replace the snapshot's entries of
                 the same name, the snapshot's others stay (sudoers.d)
    accounts     passwd/group/shadow/gshadow: the snapshot's system accounts,
                 plus B's login accounts (uid/gid >= 1000), B's entry winning
                 on a name both have; B's users stay in the groups B gave them
                 (a snapshot account holding the uid/gid of one of B's login
                 accounts under another name is left out: one name per id)
    merge        line union, the snapshot's lines first (authorized_keys):
                 never drops a key of either side
    dpkg         /var/lib/dpkg/status: the snapshot's package records, B's
                 for the NVIDIA driver packages (whose files are B's) and for
                 packages the snapshot does not have (whose files show through)

Merged files are synthesized by the keeper into ``state/host/<n>/`` (a tmpfs; the
topmost lower layer of overlay n) after the FUSE lower answers. The
defaults are :data:`DEFAULT_RULES`; ``/etc/ogrefs/host-paths`` (or
``--host-paths-file``) adds rules, ``-PATTERN`` drops a default, and
``--host-path``/``--no-host-path``/``--no-host-paths`` do the same on the
command line. The snapshot's CUDA toolkit and the nvidia-* wheels of its
venvs are not driver files and still come from the snapshot.

No locks: the mount command computes the plan (in its own process, before
the fork), the keeper writes the merged layer before any overlay is up.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import logging
import os
import signal
import stat
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from ogrefs.errors import OgrefsError, UsageError
from ogrefs.box import exact, mountsys, safepath
from ogrefs.repo.catalog import ROOT_INO

log = logging.getLogger(__name__)

KINDS = ("host", "prefer-host", "accounts", "merge", "dpkg")
LIBDIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
           "/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu", "/lib64")
#: NVIDIA driver userspace as libnvidia-container lists it (libraries, binaries, ICDs, firmware, records).
NVIDIA_LIBS = ("libcuda.so*", "libcudadebugger.so*", "libnvidia-*.so*", "libnvcuvid.so*", "libnvoptix.so*",
               "libGLX_nvidia.so*", "libEGL_nvidia.so*", "libGLESv1_CM_nvidia.so*", "libGLESv2_nvidia.so*",
               "vdpau/libvdpau_nvidia.so*", "nvidia")
NVIDIA_BINS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
               "nvidia-cuda-mps-server", "nvidia-modprobe", "nvidia-settings", "nvidia-bug-report.sh",
               "nvidia-xconfig", "nvidia-powerd")

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    # boot and swap at the top level (shown from the snapshot only where this box has none: topfiles.py)
    ("host", "/vmlinuz*"), ("host", "/initrd.img*"), ("host", "/swapfile"), ("host", "/swap.img"),
    # identity
    ("host", "/etc/hostname"), ("host", "/etc/hosts"), ("host", "/etc/machine-id"),
    ("host", "/var/lib/dbus/machine-id"), ("host", "/etc/mailname"),
    # network and name resolution
    ("host", "/etc/resolv.conf"), ("host", "/etc/network/interfaces"), ("host", "/etc/network/interfaces.d"),
    ("host", "/etc/netplan"), ("host", "/etc/NetworkManager/system-connections"),
    ("host", "/etc/systemd/network"), ("host", "/etc/systemd/resolved.conf"), ("host", "/etc/nsswitch.conf"),
    ("host", "/var/lib/dhcp"), ("host", "/var/lib/NetworkManager"),
    # disks
    ("host", "/etc/fstab"), ("host", "/etc/crypttab"), ("host", "/etc/mdadm"),
    # cloud-init
    ("host", "/var/lib/cloud"), ("host", "/etc/cloud"),
    # ssh host keys
    ("host", "/etc/ssh/ssh_host_*"),
    # the provider's login accounts
    ("accounts", "/etc/passwd"), ("accounts", "/etc/group"), ("accounts", "/etc/shadow"),
    ("accounts", "/etc/gshadow"), ("prefer-host", "/etc/sudoers.d"),
    ("merge", "/root/.ssh/authorized_keys"), ("merge", "/home/*/.ssh/authorized_keys"),
    # kernel modules, firmware, boot
    ("host", "/lib/modules"), ("host", "/usr/lib/modules"), ("host", "/lib/firmware"),
    ("host", "/usr/lib/firmware"), ("host", "/etc/modprobe.d/nvidia*"), ("host", "/etc/modules-load.d/nvidia*"),
    # the NVIDIA driver userspace
    *(("host", f"{d}/{lib}") for d in LIBDIRS for lib in NVIDIA_LIBS),
    *(("host", f"{d}/{b}") for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin") for b in NVIDIA_BINS),
    ("host", "/etc/OpenCL/vendors/nvidia*.icd"), ("host", "/etc/vulkan/icd.d/nvidia*"),
    ("host", "/usr/share/vulkan/icd.d/nvidia*"), ("host", "/usr/share/vulkan/implicit_layer.d/nvidia*"),
    ("host", "/usr/share/glvnd/egl_vendor.d/*nvidia*"), ("host", "/usr/share/egl/egl_external_platform.d/*nvidia*"),
    ("host", "/usr/share/nvidia"), ("host", "/etc/nvidia"), ("host", "/usr/src/nvidia*"),
    ("host", "/var/lib/dkms/nvidia*"), ("host", "/var/lib/dpkg/info/*nvidia*"), ("dpkg", "/var/lib/dpkg/status"),
    ("host", "/etc/X11/xorg.conf.d/*nvidia*"),
    # ogrefs itself: the command this box's units and users run, and its settings (docs/mount.md,
    # "The ogrefs command never depends on what it serves")
    ("host", "/usr/local/bin/ogrefs"), ("host", "/etc/ogrefs"),
)
CONFIG_FILE = "/etc/ogrefs/host-paths"
#: run/shell: names the directories of this box's driver libraries for the snapshot's own ldconfig
DRIVER_CONF = "/etc/ld.so.conf.d/000-ogrefs-host-driver.conf"


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: str


def parse_rules(text: str, source: str) -> tuple[list[Rule], list[str]]:
    """Rules and dropped patterns (``-PATTERN``) of a host-paths file; UsageError names the bad line."""
    rules, dropped = [], []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            dropped.append(line[1:].strip())
            continue
        kind, _, pattern = line.partition(" ") if " " in line else ("host", "", line)
        pattern = pattern.strip()
        if kind not in KINDS or not pattern.startswith("/"):
            raise UsageError(f"{source}:{n}: expected `[{'|'.join(KINDS)}] /absolute/pattern` or `-/pattern`")
        rules.append(Rule(kind, pattern))
    return rules, dropped


def load_rules(*, defaults: bool = True, files: Iterable[str] = (), add: Iterable[str] = (),
               drop: Iterable[str] = ()) -> list[Rule]:
    """The rules in force: defaults, then the config file(s), then the command line."""
    rules = [Rule(k, p) for k, p in DEFAULT_RULES] if defaults else []
    dropped = list(drop)
    for f in [CONFIG_FILE, *files]:
        try:
            text = Path(f).read_text()
        except FileNotFoundError:
            if f != CONFIG_FILE:
                raise UsageError(f"host-paths file {f} does not exist") from None
            continue
        except OSError as exc:
            raise UsageError(f"cannot read host-paths file {f}: {exc.strerror}") from None
        more, less = parse_rules(text, f)
        rules += more
        dropped += less
    for spec in add:
        kind, _, pattern = spec.partition(":") if ":" in spec and spec.split(":", 1)[0] in KINDS else ("host", "", spec)
        if not pattern.startswith("/"):
            raise UsageError(f"--host-path {spec}: give an absolute path (optionally KIND:/path)")
        rules.append(Rule(kind, pattern))
    return [r for r in rules if r.pattern not in dropped]


def with_driver(rules: list[Rule]) -> tuple[list[Rule], list[str]]:
    """``rules`` plus one host rule per file of this box's running NVIDIA driver found through its linker
    cache (inspect/driverlibs.py, as nvidia-container-toolkit finds them), and the directories they lie in."""
    from ogrefs.inspect.driverlibs import driver_libraries

    _version, libs = driver_libraries()
    return rules + [Rule("host", glob.escape(p)) for p in libs], sorted({os.path.dirname(p) for p in libs})


# -- what of the snapshot the rules take away --------------------------------------------------------
@dataclass
class HostPlan:
    """Computed by the mount command before the fork: what the FUSE view hides, what the keeper merges."""
    hidden: dict[int, frozenset] = field(default_factory=dict)  # parent ino -> names the view omits
    kept: list[str] = field(default_factory=list)  # snapshot paths replaced by this box's (or by nothing)
    merges: list[tuple[str, str]] = field(default_factory=list)  # (kind, path) synthesized from both sides
    mask: list[Any] | None = None  # exact.MaskEntry list (None: no mask: --merge, nothing the snapshot owns)
    exact: list[str] = field(default_factory=list)  # the directories shown exactly (said by mount and status)
    not_exact: list[tuple[str, str]] = field(default_factory=list)  # a whole box's candidates left merged, why
    driver_dirs: list[str] = field(default_factory=list)  # run/shell: where this box's driver libraries lie


def _match(catalog: Any, pattern: str) -> list[tuple[int, bytes, Any, str]]:
    """Entries of the catalog matching ``pattern``: (parent ino, name, node, path); no symlink followed."""
    level: list[tuple[int | None, bytes | None, Any, str]] = [(None, None, catalog.get(ROOT_INO), "")]
    for comp in [c for c in pattern.split("/") if c]:
        nxt = []
        for _p, _n, node, path in level:
            if node is None or not node.is_dir:
                continue
            if any(ch in comp for ch in "*?["):
                for name, child in catalog.children(node.ino):
                    if fnmatch.fnmatchcase(os.fsdecode(name), comp):
                        nxt.append((node.ino, name, child, f"{path}/{os.fsdecode(name)}"))
            else:
                child = catalog.lookup(node.ino, os.fsencode(comp))
                if child is not None:
                    nxt.append((node.ino, os.fsencode(comp), child, f"{path}/{comp}"))
        level = nxt
    return [(p, n, node, path) for p, n, node, path in level if p is not None]


def plan(catalog: Any, rules: list[Rule], host_root: str = "/") -> HostPlan:
    """Resolve the rules against the snapshot's catalog and this box's tree (read before any overlay)."""
    hidden: dict[int, set] = {}
    out = HostPlan()
    for rule in rules:
        for parent, name, node, path in _match(catalog, rule.pattern):
            host = os.path.join(host_root, path.lstrip("/"))
            if rule.kind == "host":
                hidden.setdefault(parent, set()).add(name)
                out.kept.append(path)
            elif rule.kind == "prefer-host" and node.is_dir and (mine := _host_names(host)):
                theirs = {n for n, _ in catalog.children(node.ino)}
                if mine & theirs:
                    hidden.setdefault(node.ino, set()).update(mine & theirs)
                    out.kept.extend(f"{path}/{os.fsdecode(n)}" for n in sorted(mine & theirs))
            elif rule.kind in ("accounts", "merge", "dpkg") and node.is_reg and os.path.lexists(host):
                out.merges.append((rule.kind, path))  # what is there is read (or refused) by read_bounded
    out.hidden = {p: frozenset(names) for p, names in hidden.items()}
    out.kept = sorted(set(out.kept))
    return out


def _host_names(path: str) -> set[bytes]:
    """Names in this box's directory ``path``, reached by safepath; none where it cannot be (said in the log)."""
    try:
        fd, _trusted = safepath.open_dir(path)
    except safepath.Untrusted as exc:
        log.warning("not preferred from this box: %s", exc)
        return set()
    except OSError:
        return set()
    try:
        return {os.fsencode(n) for n in os.listdir(safepath.fd_path(fd))}
    finally:
        os.close(fd)


class HostView:
    """A catalog as the FUSE view shows it at ``/``: host-owned entries left out (lookup and listings)."""

    def __init__(self, catalog: Any, hidden: dict[int, frozenset]) -> None:
        self._catalog = catalog
        self._hidden = hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._catalog, name)

    def lookup(self, parent: int, name: bytes) -> Any:
        if name in self._hidden.get(parent, ()):
            return None
        return self._catalog.lookup(parent, name)

    def children(self, parent: int, after: bytes | None = None, limit: int = -1) -> list:
        hide = self._hidden.get(parent)
        if not hide:
            return self._catalog.children(parent, after=after, limit=limit)
        rows = self._catalog.children(parent, after=after, limit=limit if limit < 0 else limit + len(hide))
        rows = [(n, node) for n, node in rows if n not in hide]
        return rows if limit < 0 else rows[:limit]


# -- the keeper's part: merged files, the linker cache ---------------------------------------------------
def _rows(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _login_ids(text: str) -> dict[str, int]:
    """Name -> id of the entries with an id in the login range (1000 up to, not including, nobody's 65534)."""
    return {r[0]: int(r[2]) for r in _rows(text) if len(r) > 2 and r[2].isdigit() and 1000 <= int(r[2]) < 65534}


def _all_ids(text: str) -> dict[str, int]:
    return {r[0]: int(r[2]) for r in _rows(text) if len(r) > 2 and r[2].isdigit()}


@dataclass(frozen=True)
class AccountClash:
    """Accounts of the snapshot that give way to this box's login accounts holding the same id."""
    users: dict[str, str]  # the snapshot's user -> this box's user with its uid
    groups: dict[str, str]  # the snapshot's group -> this box's group with its gid


def account_clashes(snap_dir: str, host_dir: str) -> AccountClash:
    """Which of the snapshot's accounts hold an id that one of this box's login accounts (another name) has.

    This box's login user keeps its uid (its files, its provider's login);
    the snapshot's account of that uid is left out, so the snapshot's files
    owned by that uid belong to this box's user (docs/mount.md).
    """
    def clashes(kind: str) -> dict[str, str]:
        mine = _login_ids(_read(os.path.join(host_dir, kind)))
        by_id = {i: n for n, i in mine.items()}
        return {n: by_id[i] for n, i in _all_ids(_read(os.path.join(snap_dir, kind))).items()
                if n not in mine and i in by_id}

    return AccountClash(clashes("passwd"), clashes("group"))


def merge_accounts(path: str, snap: str, host: str, host_dir: str = "/etc", snap_dir: str | None = None) -> str:
    """passwd/group/shadow/gshadow: the snapshot's entries, with this box's login accounts merged in.

    This box's login users (uid >= 1000) and groups (gid >= 1000) replace the
    snapshot's entry of the same name or are added; they stay members of the
    snapshot's groups this box had them in (sudo, docker, ...). A snapshot
    account whose id one of them holds under another name is left out (and
    dropped from group member lists): one name per id, this box's.
    """
    base = os.path.basename(path)
    ids_file = {"passwd": "passwd", "shadow": "passwd", "group": "group", "gshadow": "group"}.get(base)
    if ids_file is None:
        return merge_lines(snap, host)
    clash = account_clashes(snap_dir, host_dir) if snap_dir else AccountClash({}, {})
    gone = clash.users if ids_file == "passwd" else clash.groups
    mine = set(_login_ids(host if base == ids_file else _read(os.path.join(host_dir, ids_file))))
    users = set(_login_ids(_read(os.path.join(host_dir, "passwd"))))
    host_rows = {r[0]: r for r in _rows(host)}
    out, seen = [], set()
    members = 3 if base in ("group", "gshadow") else None
    for r in _rows(snap):
        seen.add(r[0])
        if r[0] in gone:
            continue
        if r[0] in mine and r[0] in host_rows:
            r = host_rows[r[0]]
        elif members is not None and len(r) > members:
            have = [m for m in r[members].split(",") if m and m not in clash.users]
            theirs = host_rows.get(r[0])
            add = ([m for m in theirs[members].split(",") if m in users and m not in have]
                   if theirs is not None and len(theirs) > members else [])
            r = r[:members] + [",".join(have + add)] + r[members + 1:]
        out.append(r)
    out += [r for name, r in host_rows.items() if name in mine and name not in seen]
    return "".join(":".join(r) + "\n" for r in out)


#: dpkg packages of the NVIDIA driver userspace (their files are host-owned, so their records are too);
#: Debian's CUDA toolkit packages (nvidia-cuda-toolkit, nvidia-cuda-dev, ...) are the snapshot's.
DRIVER_PACKAGES = ("*nvidia*", "libcuda1*", "libcuda.so*")
NOT_DRIVER_PACKAGES = ("nvidia-cuda-*", "nvidia-cudnn*", "*cuda-toolkit*", "nvidia-profiler", "nvidia-visual-profiler",
                       "nvidia-nsight*", "nvidia-opencl-dev", "python3-nvidia*")


def is_driver_package(name: str) -> bool:
    return (any(fnmatch.fnmatchcase(name, p) for p in DRIVER_PACKAGES)
            and not any(fnmatch.fnmatchcase(name, p) for p in NOT_DRIVER_PACKAGES))


def _stanzas(text: str) -> list[tuple[tuple[str, str], str]]:
    """((package name, architecture), stanza text) of a dpkg status file, in order."""
    out = []
    for block in text.split("\n\n"):
        block = block.strip("\n")
        if not block:
            continue
        fields = dict(ln.split(":", 1) for ln in block.splitlines() if ":" in ln and not ln.startswith(" "))
        out.append(((fields.get("Package", "").strip(), fields.get("Architecture", "").strip()), block))
    return out


def merge_dpkg_status(snap: str, host: str) -> str:
    """/var/lib/dpkg/status: the snapshot's records; this box's for the NVIDIA driver and for packages the
    snapshot does not have.

    A package record must match the files the merged tree shows. The
    driver's files are this box's (host-owned), so its records are this
    box's: the snapshot's are left out. Where both sides have a package (by
    name and architecture), the snapshot's files cover this box's in the
    overlay, so the snapshot's record stays. A package only this box has
    keeps its files visible (this box's own directory is each overlay's
    lowest layer), so its record stays too: before, ``dpkg -l`` lost every
    package of this box's own (a provider's agent, tools installed on the
    new box), and ``dpkg -S`` knew none of their files (issue 47). Order:
    the snapshot's, then this box's others in this box's order.
    """
    snap_records = _stanzas(snap)
    theirs = {key for key, _block in snap_records}
    kept = [block for key, block in snap_records if not is_driver_package(key[0])]
    kept += [block for key, block in _stanzas(host) if is_driver_package(key[0]) or key not in theirs]
    return "".join(block + "\n\n" for block in kept)


#: The most of a file the keeper reads to merge it, per kind: far above a real one (authorized_keys of
#: hundreds of keys: ~100 KiB; a dpkg status of 5,000 packages: ~10 MiB), far below what hurts the box.
MAX_MERGE_BYTES = {"merge": 1 << 20, "accounts": 16 << 20, "dpkg": 64 << 20}


class NotMerged(OgrefsError):
    """A file to merge is not a plain file reached without a user's symlink, or is too big: never read."""


def read_bounded(path: str, limit: int) -> str:
    """The text of the regular file ``path``, read as root without following what a user controls.

    Its directory is reached by safepath (a user's symlink on the way is
    refused); the file is opened ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is
    not followed, a FIFO does not block the open) and must be a regular file
    of at most ``limit`` bytes (a FIFO or device is never read, a huge file
    never held). Raises :class:`NotMerged` with the reason, OSError (ENOENT ...).
    """
    try:
        parent, _trusted = safepath.open_dir(os.path.dirname(path) or "/")
    except safepath.Untrusted as exc:
        raise NotMerged(str(exc)) from None
    try:
        try:
            fd = os.open(os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotMerged(f"{path} is a symlink: not followed") from None
            raise
    finally:
        os.close(parent)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise NotMerged(f"{path} is not a regular file")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise NotMerged(f"{path} is larger than {limit >> 20} MiB")
    return data.decode(errors="surrogateescape")


def _read(path: str) -> str:
    """``path``'s text for a merge's side reads (passwd beside shadow); "" when it cannot be read safely."""
    try:
        return read_bounded(path, MAX_MERGE_BYTES["accounts"])
    except (OSError, OgrefsError):
        return ""


def merge_lines(snap: str, host: str) -> str:
    lines = snap.splitlines()
    seen = {ln.strip() for ln in lines}
    lines += [ln for ln in host.splitlines() if ln.strip() and ln.strip() not in seen]
    return "".join(ln + "\n" for ln in lines)


@dataclass
class HostLayer:
    """What the keeper prepared: overlays with their merged layer, what was kept, the host's ldconfig."""
    overlays: list
    kept: list[str] = field(default_factory=list)
    ldconfig_fd: int | None = None
    root: str | None = None  # a run root: ldconfig -r ROOT

    def run_ldconfig(self, timeout: float = 120.0) -> str:
        """Rebuild /etc/ld.so.cache for the merged view: at /, this box's ldconfig (opened before the overlays);
        in a run root, the snapshot's own ldconfig chrooted there (its cache in its glibc's format, over its
        libraries and this box's driver), else this box's with ``-r``."""
        if self.ldconfig_fd is None:
            return "not needed"
        pid = os.fork()
        if pid == 0:  # single-threaded keeper: a plain fork, then exec through the descriptor
            try:
                env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
                if self.root:
                    os.chroot(self.root)
                    os.chdir("/")
                    for own in ("/usr/sbin/ldconfig", "/sbin/ldconfig"):
                        with contextlib.suppress(OSError):
                            os.execve(own, ["ldconfig"], env)
                os.execve(self.ldconfig_fd, ["ldconfig"], env)
            finally:
                os._exit(127)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"killed after {timeout:.0f} s"
            time.sleep(0.05)
        os.close(self.ldconfig_fd)
        code = os.waitstatus_to_exitcode(status)
        return "ran" if code == 0 else f"exit status {code}"


def prepare(overlays: list, state_dir: Path, host: HostPlan | None) -> HostLayer:
    """Write the merged files for each overlay (before it is up) and open this box's ldconfig."""
    if host is None:
        return HostLayer(list(overlays))
    out, kept = [], list(host.kept)
    if host.merges or host.mask is not None or host.driver_dirs:
        _fresh_tmpfs(state_dir / "host")
    for n, o in enumerate(overlays):
        shows = o.lower[len(str(state_dir / "lower")):] or "/"  # the snapshot path this overlay shows
        masked = exact.below(host.mask or [], shows)
        if masked and o.keep_existing:  # the box's own below, masked (exact.py)
            if exact.whole(masked):
                o = replace(o, keep_existing=False)  # all of it the snapshot's: no own layer at all
            else:
                exact.write(masked, state_dir / "host" / f"mask{n}")
                o = replace(o, mask=str(state_dir / "host" / f"mask{n}"))
        layer = state_dir / "host" / str(n)
        wrote = False
        for kind, path in host.merges:
            if not path.startswith(shows.rstrip("/") + "/"):
                continue
            rel = path[len(shows.rstrip("/")) + 1:]
            try:
                write_merged(kind, path, Path(o.lower) / rel, layer, rel, Path(o.lower))
            except NotMerged as exc:  # a user's symlink, FIFO or huge file there: said where the mount says
                log.warning("not merged: %s; the snapshot's %s is shown", exc, path)
                kept.append(f"{path}: not merged ({exc}); the snapshot's copy is shown")
                continue
            except OSError as exc:
                log.warning("cannot merge %s (%s): the snapshot's copy is shown", path, exc)
                continue
            wrote = True
            kept.append(f"{path} (merged)")
            if kind == "accounts" and path.endswith("/passwd"):
                clash = account_clashes(str((Path(o.lower) / rel).parent), os.path.dirname(path))
                kept += [f"{path}: the snapshot's {u} gives its uid to this box's {b} (merged)"
                         for u, b in sorted(clash.users.items())]
        if host.driver_dirs and shows == "/":  # run/shell: this box's driver directories for the root's ldconfig
            _write_text(layer, DRIVER_CONF.lstrip("/"), Path(o.lower), "".join(
                f"{d}\n" for d in ["# this box's NVIDIA driver libraries (ogrefs run, inspect/driverlibs.py)",
                                    *host.driver_dirs]), None)
            wrote = True
            kept.append(f"{DRIVER_CONF} (this box's driver libraries in {', '.join(host.driver_dirs)})")
        out.append(replace(o, merged=str(layer)) if wrote else o)
    fd = None
    root = overlays[0].target if overlays and overlays[0].host_dir == "/" else None  # ogrefs run/shell
    if root or any(o.target in ("/etc", "/usr") for o in overlays):
        for cand in ("/usr/sbin/ldconfig", "/sbin/ldconfig"):
            try:
                fd = os.open(os.path.realpath(cand), os.O_RDONLY | os.O_CLOEXEC)
                break
            except OSError:
                continue
    return HostLayer(out, sorted(set(kept)), fd, root)


def _fresh_tmpfs(path: Path) -> None:
    """An empty tmpfs of its own at ``path`` for the merged layers.

    A lower layer inside another lower layer of the same overlay is refused
    by the kernel (ELOOP: /var/lib/ogrefs/... is inside this box's own /var,
    the /var overlay's lowest layer); a file system of its own is inside
    nothing. The files are rebuilt at every mount, so memory is enough.
    """
    mountsys.umount(str(path), lazy=True)  # a previous mount's
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    mountsys.mount("ogrefs-host", str(path), "tmpfs", 0, "mode=0755,size=64m,nr_inodes=1m")


def unmount_layers(state_dir: Path) -> None:
    """Teardown: detach the merged layers' tmpfs (the overlays over it are gone or hold their own copy)."""
    mountsys.umount(str(state_dir / "host"), lazy=True)


def write_merged(kind: str, path: str, snap_file: Path, layer: Path, rel: str, lower_root: Path) -> None:
    """This box's ``path`` merged with the snapshot's ``snap_file`` (a copy below ``lower_root``) into
    ``layer/rel``: the keeper's merged layer, or ``/`` itself for the no-FUSE mount (mount/inplace.py)."""
    snap_text = read_bounded(str(snap_file), MAX_MERGE_BYTES[kind])
    host_text = read_bounded(path, MAX_MERGE_BYTES[kind])
    if kind == "accounts":
        text = merge_accounts(path, snap_text, host_text, host_dir=os.path.dirname(path),
                              snap_dir=str(snap_file.parent))
    elif kind == "dpkg":
        text = merge_dpkg_status(snap_text, host_text)
    else:
        text = merge_lines(snap_text, host_text)
    _write_text(layer, rel, lower_root, text, snap_file)


def _write_text(layer: Path, rel: str, lower_root: Path, text: str, attrs: Path | None) -> None:
    """``text`` at ``rel`` in ``layer`` with ``attrs``' owner and mode (None: root's 0644); the directories on
    the way carry the snapshot's attributes where it has them (an .ssh directory stays 0700 and its owner's)."""
    parts = rel.split("/")
    for i in range(1, len(parts)):
        d = layer.joinpath(*parts[:i])
        d.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            _copy_attrs(lower_root.joinpath(*parts[:i]), d)
    dest = layer / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".ogrefs-tmp")
    tmp.write_text(text, errors="surrogateescape")
    if attrs is not None:
        _copy_attrs(attrs, tmp)
    else:
        os.chmod(tmp, 0o644)
    os.replace(tmp, dest)


def _copy_attrs(src: Path, dest: Path) -> None:
    st = os.stat(src)
    os.chown(dest, st.st_uid, st.st_gid)
    os.chmod(dest, stat.S_IMODE(st.st_mode))
