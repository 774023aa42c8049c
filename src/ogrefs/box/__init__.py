"""This box, as ogrefs' mounts change it and what they record on it.

The takeover of a box by a whole-box mount (overlays, the host paths kept or
merged, top files, processes that hold old trees, the rescue script, the mount
syscalls) and the records that outlive a command (:mod:`.records`: which mounts
exist and their state; :mod:`.copyplan`: the local copy's plan, whose format
only that module reads and writes).  It sits below snapshot/ and lazy/: a
snapshot of a box running from a mount reads these records, the materializer
writes the plan.  Nothing here runs an event loop.
"""
