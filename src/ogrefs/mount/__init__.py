"""The mount: the pyfuse3 adapter, the daemon, the keeper, the calling side, `ogrefs run` (the box is box/'s)."""
