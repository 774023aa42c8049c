"""A job whose files arrive while it runs: its path system calls wait for them (seccomp user notification).

``supervisor`` runs the job and answers its calls, ``seccomp`` is the
kernel's interface, ``paths`` reads and resolves a stopped caller's path.
docs/mount.md, "A supervised job on a box without FUSE", says why seccomp,
what it costs and what escapes it.
"""
