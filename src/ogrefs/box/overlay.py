"""Writable mounts: kernel overlayfs over the lazy FUSE lower, at the original paths.

Layout of a mount's state directory (``--state-dir``, one per mount)::

    state/lower/            the FUSE mount of the snapshot (read-only, lazy)
    state/upper/<n>/        overlayfs upper dir of overlay n: every write lands here
    state/work/<n>/         overlayfs work dir of overlay n
    state/overlays.json     what is mounted where (for unmount, finalize, resume)

``plan`` decides the overlays: mounting at ``/`` gives one overlay per root
path of the snapshot, at that path (a whole-box snapshot: one per top-level
directory); any other target gets one overlay of the whole snapshot tree.
If a path already exists on this box, its content stays visible *below* the
snapshot's (it becomes the lowest layer). Paths a running system needs
(``/proc``, ``/sys``, ``/dev``, ``/run``, ``/boot``, ``/`` as a whole) are
refused unless ``force``.

Unmounting takes the overlays down in reverse order and keeps the upper
directories: mounting again with the same state directory resumes.

``OGREFS_METACOPY=1`` (opt-in, docs/mount.md) mounts new overlays with
``metacopy=on``: a chmod or chown of a file not yet local copies up its
metadata only, instead of fetching all its bytes through the FUSE lower.
Once an overlay has been mounted so, ``state/work/<n>.metacopy`` says it
and every later mount of that state uses it too (its upper directory may
hold metadata-only files that overlayfs without metacopy refuses to open).
No locks here: the mount daemon's parent process owns these calls.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat
from dataclasses import replace
from pathlib import Path

from ogrefs.box.records import Overlay, save_overlays, unescape_mountinfo  # overlays.json's format lives there
from ogrefs.box import mountsys, safepath
from ogrefs.errors import OgrefsError, UsageError

PROTECTED = ("/proc", "/sys", "/dev", "/run", "/boot")
#: Where a release keeps its programs, libraries and their state (dpkg, systemd, alternatives): what
#: ``mount --data-only`` leaves to this box, and what a mount at / of another release must not cover.
SYSTEM_DIRS = ("/usr", "/etc", "/var", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot")
#: Top-level directories of a whole-box snapshot that are never overlaid, even with --force.
NEVER = ("/proc", "/sys", "/dev", "/run", "/tmp", "/lost+found")


class OverlayError(OgrefsError):
    """overlayfs refused a mount or an unmount."""


def normalized(path: str) -> str:
    """``path`` as the kernel resolves it textually: absolute, no ``.``/``..``, no doubled slashes."""
    p = posixpath.normpath("/" + path)
    return "/" + p.lstrip("/")


def _protected(path: str) -> str | None:
    path = normalized(path)
    if path == "/":
        return "/ as a whole"
    for p in PROTECTED:
        if path == p or path.startswith(p + "/"):
            return p
    return None


def is_system(path: str) -> bool:
    """Whether ``path`` is, or lies in, one of :data:`SYSTEM_DIRS`."""
    path = normalized(path)
    return any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS)


def plan_box_root(lower_root: Path, target: Path, state_dir: Path) -> list[Overlay]:
    """``ogrefs run``/``shell``: one overlay at ``target`` showing the snapshot's ``/`` over this box's ``/``
    (masked by exact.py unless ``--merge``: the keeper adds the layer)."""
    return [Overlay(normalized(os.path.abspath(str(target))), str(lower_root), str(state_dir / "upper" / "0"),
                    str(state_dir / "work" / "0"), keep_existing=True, host_dir="/")]


def plan(roots: list[str], lower_root: Path, target: Path, state_dir: Path, force: bool = False,
         top_level: list[str] | None = None, skipped: list[dict] | None = None,
         data_only: bool = False) -> list[Overlay]:
    """The overlays that show the snapshot at ``target``; raises UsageError for protected paths.

    ``top_level``: names of the snapshot's top-level directories (for a
    whole-box snapshot), read from the catalog before anything is mounted.
    ``skipped``, when given, receives ``{"path", "reason"}`` for each
    top-level directory of the snapshot that is not overlaid.
    Paths are compared normalized (``//boot`` and ``/tmp/../proc`` are
    ``/boot`` and ``/proc``), as the kernel will resolve them.
    ``data_only`` (at ``/``): the snapshot's system directories (:data:`SYSTEM_DIRS`) are left to
    this box and listed in ``skipped``; only its data paths come back.
    """
    target_s = normalized(os.path.abspath(str(target)))
    if target_s != "/":
        why = _protected(target_s)
        if why and not force:
            raise UsageError(f"refusing to cover {target_s} on a running system (protected: {why}); "
                             "mount elsewhere, or add --force")
        return [Overlay(target_s, str(lower_root), str(state_dir / "upper" / "0"), str(state_dir / "work" / "0"),
                        keep_existing=False)]
    paths: list[str] = []
    for root in sorted({normalized(r) for r in roots}):
        if root == "/":
            # A whole-box snapshot: one overlay per top-level directory, leaving out the
            # ones a running system needs (they were not asked for by name).
            for name in sorted(top_level or []):
                p = normalized(name)
                if data_only and is_system(p) and p not in NEVER:
                    if skipped is not None:
                        skipped.append({"path": p, "reason": f"the box's own {p} is kept (--data-only)"})
                elif p in NEVER or (not force and _protected(p)):
                    if skipped is not None:
                        why = "never overlaid" if p in NEVER else "protected; --force covers it"
                        skipped.append({"path": p, "reason": f"the box's own {p} is kept ({why})"})
                elif p != "/" and p not in paths:
                    paths.append(p)
        elif data_only and is_system(root):
            if skipped is not None:
                skipped.append({"path": root, "reason": f"the box's own {root} is kept (--data-only)"})
        elif root not in paths:
            paths.append(root)
    refused = [(p, why) for p in paths if (why := _protected(p))]
    if refused and not force:
        names = ", ".join(p for p, _ in refused)
        raise UsageError(f"refusing to cover {names} on a running system (protected: {refused[0][1]}); "
                         "mount elsewhere, or add --force")
    overlays = []
    for i, p in enumerate(paths):
        for ch in (":", ",", "\\"):
            if ch in p:
                raise UsageError(f"{p}: overlayfs cannot take a path containing {ch!r}")
        overlays.append(Overlay(p, str(lower_root) + p, str(state_dir / "upper" / str(i)),
                                str(state_dir / "work" / str(i)), keep_existing=True))
    return overlays


def mounts_below(target: str, source: str | None = None) -> list[str]:
    """Mount points strictly below ``target`` in this namespace (from mountinfo), outermost first.

    ``source``: only the mounts of that source name (e.g. ``ogrefs-local``: ours, not the box's).
    """
    prefix = target.rstrip("/") + "/"
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 5 or (source is not None and _source(fields) != source):
                    continue
                point = unescape_mountinfo(fields[4])
                if point.startswith(prefix) and point not in found:
                    found.append(point)
    except OSError:
        pass
    return found


def _source(fields: list[str]) -> str | None:
    """A mountinfo line's mount source (the field after the file-system type)."""
    try:
        return unescape_mountinfo(fields[fields.index("-") + 2])
    except (ValueError, IndexError):
        return None


def outermost(paths: list[str]) -> list[str]:
    """Drop every path that lies below another one of the list (a recursive bind brings it along)."""
    out: list[str] = []
    for p in sorted(set(paths), key=lambda x: (x.count("/"), x)):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def kept_below(o: Overlay, keep: list[str]) -> list[str]:
    """What of the box must stay visible inside ``o``: its submounts and ogrefs' own directories."""
    prefix = o.target.rstrip("/") + "/"
    own = [k for k in keep if k.startswith(prefix) and os.path.isdir(k)]
    state_root = os.path.dirname(os.path.dirname(o.upper))  # state/upper/<n> -> state
    subs = [m for m in mounts_below(o.target)
            if not (m == state_root or m.startswith(state_root + "/"))]  # our own FUSE lower: in state
    return outermost(own + subs)


def lowerdir(o: Overlay, own: str | None = None) -> str:
    """The overlay's lower layers, top first: synthesized host files, the snapshot, the box's own (``own``:
    how the options name that directory, :func:`_own_layer`; None: no such layer)."""
    layers = [o.merged] if o.merged else []
    layers.append(o.lower)
    if own is not None:
        if o.mask:
            layers.append(o.mask)  # what of the box's own stays hidden below the snapshot's (exact.py)
        layers.append(own)  # the box's own content stays visible below the snapshot's
    return ":".join(layers)


METACOPY_ENV = "OGREFS_METACOPY"


def _metacopy_marker(o: Overlay) -> str:
    return o.work.rstrip("/") + ".metacopy"


def uses_metacopy(o: Overlay) -> bool:
    """Whether ``o`` is mounted with ``metacopy=on``: asked for now, or ever before for this state."""
    return os.path.exists(_metacopy_marker(o)) or os.environ.get(METACOPY_ENV) == "1"


def mount_options(o: Overlay, lowers: str) -> str:
    metacopy = ",metacopy=on" if uses_metacopy(o) else ""  # implies redirect_dir=on (the kernel's rule)
    return f"lowerdir={lowers},upperdir={o.upper},workdir={o.work}{metacopy}"


class Refused(OverlayError):
    """A path the overlay would be mounted on, or a directory it would bind back, is reached through a
    symlink that a user other than root controls: left out (the box keeps its own tree there)."""


def _open_target(o: Overlay) -> tuple[int, bool]:
    """``o``'s target as safepath reaches it (made if missing); :class:`Refused` with the reason."""
    try:
        return safepath.open_dir(o.target, create=True)
    except safepath.Untrusted as exc:
        raise Refused(f"{o.target} not overlaid: {exc}") from None
    except OSError as exc:
        raise OverlayError(f"overlay at {o.target} failed: {exc.strerror}") from None


def _own_layer(o: Overlay, target_fd: int, trusted: bool, hold: bool) -> tuple[int | None, str | None]:
    """The box's own directory as the overlay's lowest layer: a descriptor of it and how the options name it.

    No layer (not kept, or empty): no name, and a descriptor only with
    ``hold`` (the keeper), of the directory the overlay covers all the same:
    ``finalize`` reaches through it what is mounted below the overlay, the
    FUSE lower where the state directory lies there (client._lower_below).
    Named by its path when root alone controls every step to it (the kernel
    then finds the same directory), else by ``/proc/self/fd/N`` of the
    descriptor: never by a path a user can point elsewhere between this look
    and the mount.
    """
    if not o.keep_existing and not hold:
        return None, None
    if o.host_dir:
        try:
            fd, trusted = safepath.open_dir(o.host_dir)
        except safepath.Untrusted as exc:
            if not o.keep_existing:
                return None, None  # not a layer: nothing refused, only not held
            raise Refused(f"{o.target} not overlaid: {exc}") from None
    else:
        fd = os.dup(target_fd)
    if not o.keep_existing or not os.listdir(safepath.fd_path(fd)):
        if hold:
            return fd, None
        os.close(fd)
        return None, None
    return fd, (o.host_dir or o.target) if trusted else safepath.fd_path(fd)


def mount_one(o: Overlay, keep: list[str] | None = None, hold_own: bool = False) -> Overlay:
    """Mount ``o``; then bind the box's submounts and ogrefs' own directories back on top of it.

    Returns ``o`` with ``binds`` set to what was bound back (saved, so unmount
    takes them down first). The target, the own layer and the directories to
    bind back are reached by safepath (no symlink a user controls followed,
    :class:`Refused` otherwise) and used through their descriptors.

    ``hold_own`` (the keeper, which lives as long as the mount): the descriptor
    of the box's own directory below (opened before the mount; the lowest
    layer, or without one the directory the overlay covers) is left open; the
    result records it (``own_fd``, its ``own_dev``/``own_ino``, the overlay's
    ``mount_id``). Otherwise those are None:
    an overlay mounted again by another process (finalize, a rollback) never
    carries a descriptor that is not the one its lowest layer was opened from.
    """
    target_fd, trusted = _open_target(o)
    own_fd = None
    try:
        own_fd, own = _own_layer(o, target_fd, trusted, hold_own)
        up = _mount_one(o, keep, target_fd, lowerdir(o, own))
    except BaseException:
        if own_fd is not None:
            os.close(own_fd)
        raise
    finally:
        os.close(target_fd)
    if own_fd is None or not hold_own:
        if own_fd is not None:
            os.close(own_fd)
        return replace(up, own_fd=None, own_dev=None, own_ino=None, mount_id=None)
    st = os.fstat(own_fd)
    return replace(up, own_fd=own_fd, own_dev=st.st_dev, own_ino=st.st_ino, mount_id=mountsys.mount_id(o.target))


def _mount_one(o: Overlay, keep: list[str] | None, target_fd: int, lowers: str) -> Overlay:
    """:func:`mount_one` but for the own directory's descriptor: mount with ``lowers`` on ``target_fd``,
    bind back, return ``o``."""
    for d in (o.upper, o.work):
        os.makedirs(d, mode=0o700, exist_ok=True)
    # overlayfs shows the upper directory's own attributes on the mount's root:
    # give it the snapshot directory's, or the root would read as 0700 root:root.
    st = os.stat(o.lower)
    if not os.listdir(o.upper):
        os.chown(o.upper, st.st_uid, st.st_gid)
        os.chmod(o.upper, stat.S_IMODE(st.st_mode))
        os.utime(o.upper, ns=(st.st_atime_ns, st.st_mtime_ns))
    back = kept_below(o, keep or [])
    fds: dict[str, int] = {}
    root = None
    try:
        for p in back:
            fds[p] = open_kept(o, p)
        mount_overlay(o, safepath.fd_path(target_fd), lowers)
        root = _overlay_root(o, target_fd)
        check_writable(o, root)
        bind_back(o, root, fds)
    finally:
        for fd in list(fds.values()) + ([root] if root is not None else []):
            os.close(fd)
    return replace(o, binds=tuple(back))


def mount_overlay(o: Overlay, at: str, lowers: str) -> None:
    """mount(2) of ``o`` with the lower layers ``lowers`` on ``at`` (its target's descriptor, or where
    finalize puts it together); OverlayError naming the target if the kernel refuses."""
    try:
        mountsys.overlay(at, mount_options(o, lowers))
    except OSError as exc:
        extra = " (with metacopy=on)" if uses_metacopy(o) else ""
        raise OverlayError(f"overlay at {o.target} failed{extra}: {exc.strerror}") from None


def check_writable(o: Overlay, root: int) -> None:
    """The overlay just mounted (its root open as ``root``) is writable, else detached and OverlayError."""
    if os.fstatvfs(root).f_flag & os.ST_RDONLY:  # the kernel could not use the work directory
        mountsys.umount(safepath.fd_path(root), lazy=True)
        raise OverlayError(f"overlay at {o.target} came up read-only: the kernel cannot use its work "
                           f"directory {o.work} (immutable, read-only or full? see dmesg)")
    if uses_metacopy(o):
        Path(_metacopy_marker(o)).touch()


def _overlay_root(o: Overlay, target_fd: int) -> int:
    """A descriptor of the root of the overlay just mounted on ``target_fd``: its path walked again.

    Proven to be that overlay (its upper directory, on the mount the target
    lies on); a target a user moved meanwhile is no longer reached by the
    path: the overlay is detached where it went and :class:`Refused` says so.
    """
    ours = [m for m in mountsys.overlays_with_upper(o.upper) if m[1] == safepath.mount_id_of(target_fd)]
    try:
        fd = safepath.open_dir(o.target)[0]
    except (OSError, OgrefsError):
        fd = None
    if fd is not None and safepath.mount_id_of(fd) in [m[0] for m in ours]:
        return fd
    if fd is not None:
        os.close(fd)
    for _id, _parent, where in ours:
        mountsys.umount(where, lazy=True)
    raise Refused(f"{o.target} not overlaid: it was moved away while the overlay went up")


def open_kept(o: Overlay, path: str) -> int:
    """A descriptor of ``path`` (a directory to keep visible inside ``o``), opened before ``o`` covers it."""
    try:
        return safepath.open_dir(path)[0]
    except safepath.Untrusted as exc:
        raise Refused(f"{o.target} not overlaid: {path} cannot be kept visible: {exc}") from None
    except OSError as exc:
        raise OverlayError(f"overlay at {o.target}: cannot keep {path} visible ({exc.strerror})") from None


def bind_back(o: Overlay, root: int, fds: dict[str, int]) -> None:
    """Bind each directory of ``fds`` back at its path inside the overlay whose root is open as ``root``.

    The place is walked from that root following no symlink at all (what is
    there is the snapshot's and the upper directory's, not the box's); on any
    failure the overlay is detached with what was bound inside it, and OverlayError says why.
    """
    p = ""
    try:
        for p, fd in fds.items():
            try:
                at = safepath.open_dir(p[len(o.target.rstrip("/")):], create=True, start=root, follow=False)[0]
            except safepath.Untrusted as exc:
                raise Refused(f"{o.target} not overlaid: {p} cannot be kept visible inside it: {exc}") from None
            try:
                mountsys.bind(safepath.fd_path(fd), safepath.fd_path(at), recursive=True)
            finally:
                os.close(at)
    except (OSError, OverlayError) as exc:
        mountsys.umount(safepath.fd_path(root), lazy=True)  # detached with what was bound inside it
        if isinstance(exc, OverlayError):
            raise
        raise OverlayError(f"overlay at {o.target}: cannot keep {p} visible ({exc.strerror})") from None


def mount_all(overlays: list[Overlay], state_dir: Path, keep: list[str] | None = None,
              hold_own: bool = False, refused: list[str] | None = None) -> list[Overlay]:
    """Mount every overlay or none (those already up are taken down again); saves and returns them.

    ``hold_own``: see :func:`mount_one` (the keeper's call; its descriptors stay open for its life).
    ``refused``, when given, receives the one-line reason of each overlay left out (:class:`Refused`:
    a user's symlink on the way) instead of the whole mount failing on it.
    """
    done: list[Overlay] = []
    try:
        for o in overlays:
            try:
                done.append(mount_one(o, keep, hold_own))
            except Refused as exc:
                if refused is None:
                    raise
                refused.append(str(exc))
    except BaseException:
        unmount_all(done, lazy=True)
        for fd in (o.own_fd for o in done if o.own_fd is not None):
            os.close(fd)
        raise
    save_overlays(done, state_dir)
    return done


#: The mount source of :func:`shim_local_copy`'s overlays (how :func:`unmount_shims` knows its own).
SHIM_SOURCE = "ogrefs-local"


def shim_local_copy(o: Overlay, state_dir: Path, below: str | None = None) -> None:
    """Before ``finalize`` mounts ``o`` over the local copy: give that lower layer a file system of its own.

    The local copy lives in the state directory, by default under /var; for
    the /var overlay it is then inside another of its lower layers (this
    box's own /var), which the kernel refuses (ELOOP). A read-only overlay of
    the copy's directory alone (over an empty directory on a small tmpfs,
    ``<state>/shim``), mounted on that directory itself, is inside nothing:
    same files, same path (overlays.json and snapshots of the box read it
    unchanged). Only where needed, and once (a rerun after a kill finds it).

    ``below``: the state directory as it is below the old overlays (finalize
    puts the new /var overlay together while the old one still covers it):
    one more shim there, which an overlay mounted again later by path (an
    unmount's rollback) finds once the /var overlay, and the state directory
    bound back on it with the first shim, are gone.
    """
    own = os.path.realpath(o.host_dir or o.target).rstrip("/") + "/"
    if not o.keep_existing or not os.path.realpath(o.lower).startswith(own):
        return
    for state in [str(state_dir)] + ([below] if below else []):
        _shim_at(o, state + o.lower[len(str(state_dir)):], os.path.join(state, "shim"))


def _shim_at(o: Overlay, lower: str, shim: str) -> None:
    if _top_is(lower, "overlay", SHIM_SOURCE):
        return  # put up by a finalize that was killed before its end
    if not _top_is(shim, "tmpfs", "ogrefs-shim"):
        os.makedirs(shim, mode=0o700, exist_ok=True)
        mountsys.mount("ogrefs-shim", shim, "tmpfs", 0, "mode=0755,size=1m")
        os.makedirs(os.path.join(shim, "empty"), exist_ok=True)
    try:
        mountsys.mount(SHIM_SOURCE, lower, "overlay", mountsys.MS_RDONLY, f"lowerdir={lower}:{shim}/empty")
    except OSError as exc:
        raise OverlayError(f"local copy for {o.target} failed: {exc.strerror}") from None


def _top_is(path: str, fstype: str, source: str) -> bool:
    """Whether ``path`` (``/proc/<pid>/fd/<n>/...`` too) is the root of a mount of that type and source."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        mid = safepath.mount_id_of(fd)
    finally:
        os.close(fd)
    row = next((r for r in mountsys.mount_table() if r.id == mid), None)
    return row is not None and (row.fstype, row.source) == (fstype, source)


def unmount_shims(state_dir: Path) -> None:
    """Detach what :func:`shim_local_copy` mounted (after the overlays over them are down), nothing else."""
    for p in reversed(mounts_below(str(state_dir / "tree"), source=SHIM_SOURCE)):
        mountsys.umount(p, lazy=True)
    mountsys.umount(str(state_dir / "shim"), lazy=True)


def unmount_one(o: Overlay, lazy: bool = False) -> str | None:
    """Take ``o`` down (its bound-back directories first); None, or why not (then it stays as it was).

    Nothing is touched unless an overlay is mounted at the target: the paths
    bound back are the box's own mounts once the overlay is gone.
    """
    if not _ours(o):
        return None
    fds = {}
    for p in o.binds:
        with contextlib.suppress(OSError):
            fds[p] = os.open(p, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for p in reversed(o.binds):
            mountsys.umount(p, lazy=True)  # only our copy of the box's mount: the original stays
        err = mountsys.umount(o.target, lazy=lazy)
        if err:
            for p in o.binds:  # put them back: the overlay is still up
                with contextlib.suppress(OSError, KeyError):
                    mountsys.bind(f"/proc/self/fd/{fds[p]}", p, recursive=True)
            inside = mounted_inside(o)
            return f"{o.target}: {err}" + (f" ({inside[0]} was mounted inside it later)" if inside else "")
        return None
    finally:
        for fd in fds.values():
            os.close(fd)


def mounted_inside(o: Overlay) -> list[str]:
    """Mounts below ``o``'s target that are not its own binds (nor inside them): made after ``o`` went up."""
    own = [b.rstrip("/") + "/" for b in o.binds]
    return [m for m in mounts_below(o.target) if m not in o.binds and not m.startswith(tuple(own))]


def unmount_all(overlays: list[Overlay], lazy: bool = False, keep: list[str] | None = None) -> list[str]:
    """Unmount in reverse order; all or nothing: returns the errors (empty when all went).

    When one overlay cannot go (busy), the ones already taken down are
    mounted again, so the box never shows half one snapshot and half its own
    tree; the first error says which overlay refused, any further one which
    could not be mounted again (then the box *is* mixed: the caller says so
    and saves what is still up, :func:`still_mounted`).
    """
    down: list[Overlay] = []
    for o in reversed(overlays):
        err = unmount_one(o, lazy=lazy)
        if err:
            errors = [err]
            for again in reversed(down):
                errors += mount_again(again, keep)
            return errors
        down.append(o)
    return []


def still_mounted(overlays: list[Overlay]) -> list[Overlay]:
    """Those of ``overlays`` that have an overlay mounted at their target now (for a truthful overlays.json)."""
    return [o for o in overlays if _ours(o)]


def _ours(o: Overlay) -> bool:
    """Whether the top mount at ``o``'s target is an overlay ogrefs made (not the box's own, e.g. a container's)."""
    return mountsys.is_ogrefs(mountsys.mount_at(o.target), "overlay")


def mount_with(o: Overlay, keep: list[str], inside: dict[str, list[int]]) -> Overlay:
    """:func:`mount_one`, then a copy of each mount ``inside`` (held by box/swap.py) on top; all or nothing.

    They are not added to ``binds``: they are this box's mounts, which a later unmount must not take away
    in silence (it reports them as mounted inside, as before the finalize).
    """
    up = mount_one(o, keep)
    done: list[str] = []
    try:
        for p, fds in inside.items():
            mountsys.attach_tree(fds[0], p)
            os.close(fds.pop(0))  # attached: the mount lives on without it
            done.append(p)
    except OSError as exc:
        for q in reversed(done):
            mountsys.umount(q, lazy=True)
        unmount_one(up, lazy=True)
        raise OverlayError(f"{o.target}: cannot keep {p} (mounted inside it) visible ({exc.strerror})") from None
    return up


def mount_again(o: Overlay, keep: list[str], inside: dict[str, list[int]] | None = None) -> list[str]:
    """Mount ``o`` as it was (with the box's mounts ``inside`` it); [] when done, else why not (one item)."""
    try:
        mount_with(o, keep, inside or {})
    except (OgrefsError, OSError) as exc:
        return [f"{o.target} could not be mounted again ({exc})"]
    return []
