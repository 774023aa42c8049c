"""``finalize``'s swap: each overlay of a writable mount again over the local copy instead of the FUSE lower.

Same upper and work directories, so no write is lost; all or nothing. The
promise (docs/mount.md, "Unmount and finalize of a whole box"): at every
moment, a kill included, each target shows the box, never nothing.

Where the kernel has ``MOVE_MOUNT_BENEATH`` (Linux 6.5), each new overlay is
put together away from the box first: mounted on ``<stage>/<n>``, a private
tmpfs of this finalize in the runtime directory, with everything the old
overlay shows mounted inside it bound or attached at the same places; then
moved *beneath* the old one at the target (the target still shows the old
one), then the old one is detached (the target shows the new one, whole).
Its lowest layer, the box's own directory the old overlay covers, is named
by the keeper's descriptor of it (``records.own_layer_root``). A finalize
killed at any step leaves either the old overlay on top (a staged overlay on
the private tmpfs goes with the next run's, or an overlay already beneath
the old one is what the rerun shows after detaching the old one), or the new
one; the rerun takes each target from where it is (:func:`_where`).

Without it (an older kernel, no keeper's descriptor of the own directory:
the keeper was killed, or a target where the kernel refuses the move), the
old order stays: the old overlay detached with everything in it in one
umount2, then the new one mounted, so the target shows this box's own
directory for that moment; a finalize killed then leaves it so until it is
rerun (which also takes down and mounts again a new overlay killed before
its binds: "partial").

No locks: the ``finalize`` command alone calls this, after checking that
nothing but the caller holds the overlays.
"""

from __future__ import annotations

import errno
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

from ogrefs.box import mountsys, safepath
from ogrefs.box.overlay import (bind_back, check_writable, lowerdir, mount_again, mount_overlay, mount_with,
                                mounted_inside, open_kept, outermost, shim_local_copy, still_mounted, unmount_one,
                                unmount_shims)
from ogrefs.box.records import MountError, Overlay, save_overlays
from ogrefs.errors import OgrefsError

#: The source of the private tmpfs on which new overlays are put together (how a rerun knows it is ours).
STAGE_SOURCE = "ogrefs-stage"
#: :func:`_own_layer`'s answer when the old overlay has the box's own directory as its lowest layer and
#: nothing names that directory without going through the overlay: the swap must take the old order.
_UNREACHABLE = "unreachable"


def _work_dir_problem(o: Overlay) -> str | None:
    """Why the kernel could not use ``o``'s work directory for a new mount (it would mount read-only), or None."""
    probe = os.path.join(o.work, ".ogrefs-probe")
    try:
        os.mkdir(probe, 0o700)
        os.rmdir(probe)
    except OSError as exc:
        return f"{o.target}: its work directory {o.work} is not usable ({exc.strerror})"
    return None


def _finalize_problem(o_new: Overlay) -> str | None:
    """What would make the swap of ``o_new`` fail, checked before anything is touched."""
    if not os.path.isdir(o_new.lower):
        return f"{o_new.target}: its local copy {o_new.lower} is not a directory"
    return _work_dir_problem(o_new)


def _over(o: Overlay, root: str, lower_root: str, tree_root: str) -> Overlay:
    """``o`` with its snapshot layer under ``root`` (the FUSE lower or the local copy), whichever it has now:
    a rerun's overlays.json lists the ones a killed finalize swapped already."""
    for was in (lower_root, tree_root):
        if o.lower == was or o.lower.startswith(was + "/"):
            return replace(o, lower=root + o.lower[len(was):])
    raise MountError(f"cannot finalize: {o.target}'s layer {o.lower} is neither the snapshot's nor its local copy")


def swap_lowers(state: Path, old: list[Overlay], keep: list[str], *, stage: Path,
                own_roots: dict[str, str | None] | None = None, below: list[int] | None = None,
                swapped_all: Callable[[list[Overlay]], None] = lambda new: None) -> list[Overlay]:
    """Each of ``old`` (overlays.json's) over ``state/tree``; returns the new ones, saved in overlays.json.

    ``stage``: the directory for :data:`STAGE_SOURCE`'s tmpfs. ``own_roots``: per target, the keeper's
    ``/proc/<pid>/fd/<n>`` of the box's own directory below it (None: unknown). ``below``: receives an
    O_PATH descriptor of the state directory as it is below each overlay that covers it, when the old
    order made one reachable (the caller detaches the FUSE lower there). Checked first what can be (each
    local copy a directory, each work directory usable). If a new overlay cannot be put up, those
    already swapped go back to the FUSE lower (:func:`_swap_back`) and overlays.json says what is
    mounted. ``swapped_all(new)`` runs once every new overlay is up, before this returns: the caller
    records the finalize there, while the FUSE lower still serves (its daemon's keeper tears down a
    mount not marked finalized once the daemon goes). After each target, overlays.json says what is
    mounted, so a rerun after a kill starts from the truth.
    """
    olds, news = _olds_news(state, old)
    take_down_partial(state, old)  # mounted again below, whole
    problems = [p for o in news if (p := _finalize_problem(o))]
    if problems:
        raise MountError(f"cannot finalize: {problems[0]}; nothing was changed")
    beneath = mountsys.can_mount_beneath()
    clear_stage(stage)  # what a finalize killed while putting an overlay together left there
    swapped: list[Overlay] = []
    held: dict[str, dict[str, list[int]]] = {}  # per target: copies of the box's mounts made inside it
    try:
        for o_old, o_new in zip(olds, news):  # one by one: each target shows the same tree before and after
            try:
                swapped.append(_swap_one(state, o_old, o_new, keep, stage, beneath, (own_roots or {}), below, held))
            except (OgrefsError, OSError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise MountError(f"cannot finalize: {why}; {_swap_back(state, olds, swapped, keep, held)}") from None
            save_overlays(swapped + olds[len(swapped):], state)
        swapped_all(swapped)
    finally:
        clear_stage(stage)
        for fd in [fd for copies in held.values() for fds in copies.values() for fd in fds]:
            os.close(fd)
    return swapped


def _olds_news(state: Path, old: list[Overlay]) -> tuple[list[Overlay], list[Overlay]]:
    """Each of ``old`` over the FUSE lower and over the local copy (without binds: they are put back)."""
    lower_root, tree_root = str(state / "lower"), str(state / "tree")
    return ([_over(o, lower_root, lower_root, tree_root) for o in old],
            [replace(_over(o, tree_root, lower_root, tree_root), binds=()) for o in old])


def take_down_partial(state: Path, old: list[Overlay]) -> None:
    """Detach each new overlay that the old order mounted but a kill kept from its binds ("partial"):
    what is below shows until it is mounted again, whole. ``old``: overlays.json's (read where it is)."""
    for o_old, o_new in zip(*_olds_news(state, old)):
        if _where(o_old, o_new) == "partial":
            mountsys.umount(o_old.target, lazy=True)


def _swap_one(state: Path, o_old: Overlay, o_new: Overlay, keep: list[str], stage: Path, beneath: bool,
              own_roots: dict[str, str | None], below: list[int] | None,
              held: dict[str, dict[str, list[int]]]) -> Overlay:
    """Swap one target, from where it is (:func:`_where`); the overlay now mounted there."""
    where = _where(o_old, o_new)
    if where == "new":
        return replace(o_new, binds=o_old.binds)
    if where == "both":  # the new one beneath the old one: what is left to do is detach the old one
        _private_binds(o_old)
        mountsys.umount(o_old.target, lazy=True)
        return replace(o_new, binds=o_old.binds)
    held[o_old.target] = _hold_mounted_inside(o_old) if where == "old" else {}
    own = _own_layer(o_old, own_roots.get(o_old.target)) if where == "old" and beneath else _UNREACHABLE
    if own != _UNREACHABLE:
        shim_local_copy(o_new, state, below=_state_below(state, o_old, own))
        try:
            _swap_beneath(o_old, o_new, own, stage, held[o_old.target])
            return replace(o_new, binds=o_old.binds)
        except _NotBeneath:  # the kernel would not here (propagation it refuses): nothing changed, old order
            clear_stage(stage)  # with the copies attached on it: copied again
            for fd in (fd for fds in held.pop(o_old.target).values() for fd in fds):
                os.close(fd)
            held[o_old.target] = _hold_mounted_inside(o_old)
    if where == "old":  # the old order: the box's own directory shows for a moment (the module's docstring)
        _private_binds(o_old)
        mountsys.umount(o_old.target, lazy=True)  # with everything mounted in it, in one step
    if below is not None and str(state).startswith(o_old.target.rstrip("/") + "/"):
        below.append(os.open(state, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
    shim_local_copy(o_new, state)
    return mount_with(o_new, keep, held[o_old.target])


def _where(o_old: Overlay, o_new: Overlay) -> str:
    """What of ours is at the target: "old" (over the FUSE lower) on top, "new" (over the local copy) on top,
    "both" (the new one beneath the old one: a finalize killed between the two steps), "partial" (the new
    one without all its binds: the old order killed between its mount and its binds), or "none"."""
    table = mountsys.mount_table()
    top = mountsys.mount_at(o_old.target)
    if top is None:
        return "none"

    def over(row: mountsys.MountRow, o: Overlay) -> bool:
        return (mountsys.is_ogrefs(row, "overlay") and row.option("upperdir") == o.upper
                and o.lower in (row.option("lowerdir") or "").split(":"))

    if over(top, o_new):
        bound = {r.point for r in table if r.parent == top.id}
        return "new" if all(p in bound for p in o_old.binds) else "partial"
    if not over(top, o_old):
        return "none"
    below = [r for r in table if r.id == top.parent and r.point == top.point]
    return "both" if below and over(below[0], o_new) else "old"


def _own_layer(o_old: Overlay, own_root: str | None) -> str | None:
    """How the new overlay names the box's own directory below ``o_old`` (None: it has no such layer, as
    the old one has none), or :data:`_UNREACHABLE` when the old one has it and ``own_root`` is unknown."""
    row = mountsys.mount_at(o_old.target)
    layers = (row.option("lowerdir") if row is not None else None) or ""
    if len(layers.split(":")) <= (2 if o_old.merged else 1):
        return None
    return own_root or _UNREACHABLE


def _state_below(state: Path, o: Overlay, own: str | None) -> str | None:
    """The state directory through ``own`` (the box's directory below ``o``), when ``o`` covers it."""
    host = o.host_dir or o.target
    if own is None or not str(state).startswith(host.rstrip("/") + "/"):
        return None
    return os.path.join(own, os.path.relpath(state, host))


def clear_stage(stage: Path) -> None:
    """Detach the staging tmpfs with whatever was put together on it (never anything else at that path)."""
    for _ in range(4):  # one, or one more left by a finalize killed in between
        row = mountsys.mount_at(stage)
        if row is None or (row.fstype, row.source) != ("tmpfs", STAGE_SOURCE):
            return
        mountsys.umount(str(stage), lazy=True)


class _NotBeneath(Exception):
    """move_mount(2) refused MOVE_MOUNT_BENEATH at this target (EINVAL): nothing of the swap was seen."""


def _private_binds(o: Overlay) -> None:
    """Make ``o``'s bind-backs (and the copies of mounts they brought along) private before ``o`` is detached.

    On a box whose ``/`` is shared (systemd's default) a bind of this box's
    state directory is a peer of ``/``, and so its copies of the FUSE lower
    and of the host layers are peers of the originals: detaching the old
    ``/var`` overlay with its bind-back propagated the unmount to the
    originals, and ``finalize`` then found neither ``<state>/lower`` nor
    ``<state>/host`` for the new overlays (nor for the rollback: the box was
    left on its own files, issue 47). Private, their detachment stays theirs.
    """
    for b in o.binds:
        if mountsys.mount_at(b) is not None:
            mountsys.mount("none", b, None, mountsys.MS_REC | mountsys.MS_PRIVATE)


def _swap_beneath(o_old: Overlay, o_new: Overlay, own: str | None, stage: Path,
                  inside: dict[str, list[int]]) -> None:
    """Put ``o_new`` together on the stage, move it beneath ``o_old`` at the target, detach ``o_old``.

    Until the move nothing of it is seen from the box (a failure detaches the
    stage); the move changes nothing that is seen; the detach shows ``o_new``
    with the same directories bound back and the box's later mounts inside it.
    """
    target_fd = safepath.open_dir(o_old.target)[0]  # the old overlay's root (checked: :func:`_where`)
    own_fd = None if own is None else os.open(own, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    fds = {p: open_kept(o_old, p) for p in o_old.binds}  # what the old one shows there, bound again below
    try:
        point = _stage_point(stage, o_new)
        mount_overlay(o_new, point, lowerdir(o_new, None if own_fd is None else safepath.fd_path(own_fd)))
        root = os.open(point, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            check_writable(o_new, root)
            bind_back(o_new, root, fds)
            _attach_inside(o_new, root, inside)
        finally:
            os.close(root)
        try:
            mountsys.move_beneath(point, target_fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            raise _NotBeneath() from None
        _private_binds(o_old)
        mountsys.umount(safepath.fd_path(target_fd), lazy=True)  # the old one, with what was mounted in it
    finally:
        for fd in [target_fd, *fds.values()] + ([own_fd] if own_fd is not None else []):
            os.close(fd)


def _stage_point(stage: Path, o: Overlay) -> str:
    """An empty directory on the private staging tmpfs (mounted first if needed) for ``o``."""
    row = mountsys.mount_at(stage)
    if row is None or (row.fstype, row.source) != ("tmpfs", STAGE_SOURCE):
        os.makedirs(stage, mode=0o700, exist_ok=True)
        mountsys.private_tmpfs(str(stage), STAGE_SOURCE)
    point = stage / os.path.basename(o.upper)  # upper/<n>: one per overlay
    os.makedirs(point, mode=0o700, exist_ok=True)
    return str(point)


def _attach_inside(o: Overlay, root: int, inside: dict[str, list[int]]) -> None:
    """Attach one copy of each mount :func:`_hold_mounted_inside` held at its place inside the overlay at
    ``root`` (walked following no symlink); the other copy stays for a swap back."""
    for p, copies in inside.items():
        at = safepath.open_dir(p[len(o.target.rstrip("/")):], create=True, start=root, follow=False)[0]
        try:
            mountsys.attach_tree(copies[0], at)
        finally:
            os.close(at)
        os.close(copies.pop(0))  # attached: the mount lives on without it


def _hold_mounted_inside(o: Overlay) -> dict[str, list[int]]:
    """Two detached copies of each mount this box made inside ``o`` after it went up (a disk under /usr).

    Detaching ``o`` detaches them too (MNT_DETACH takes the whole subtree):
    a copy goes on the new overlay, the other on the old one if it has to be
    mounted again. Raises OSError (nothing detached yet) if one cannot be copied.
    """
    copies: dict[str, list[int]] = {}
    try:
        for p in outermost(mounted_inside(o)):
            copies[p] = [mountsys.clone_tree(p)]
            copies[p].append(mountsys.clone_tree(p))
    except OSError:
        for fd in (fd for fds in copies.values() for fd in fds):
            os.close(fd)
        raise
    return copies


def _swap_back(state: Path, old: list[Overlay], swapped: list[Overlay], keep: list[str],
               held: dict[str, dict[str, list[int]]]) -> str:
    """Undo a finalize that failed at ``old[len(swapped)]``: every overlay over the FUSE lower again.

    Returns the end of the one-line reason: "nothing was changed", or which
    overlays could not be put back (they show this box's own files now).
    Saves in ``overlays.json`` what is mounted afterwards, whatever happened.
    """
    lost: list[str] = []
    failed = old[len(swapped)]
    if mountsys.mounted_fstype(Path(failed.target)) != "overlay":
        lost += mount_again(failed, keep, held.get(failed.target, {}))
    for o_back, o_done in reversed(list(zip(old, swapped))):
        unmount_one(o_done, lazy=True)  # with our bind of the box's mounts inside: the held originals stay
        lost += mount_again(o_back, keep, held.get(o_back.target, {}))
    unmount_shims(state)
    save_overlays(still_mounted(old), state)
    if not lost:
        return "nothing was changed"
    return (f"and {'; '.join(lost)}: those show this box's own files now, the others the snapshot's "
            "as before; `ogrefs unmount` then mount again")


__all__ = ["STAGE_SOURCE", "clear_stage", "swap_lowers", "take_down_partial"]
