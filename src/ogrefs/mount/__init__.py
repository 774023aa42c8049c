"""The mount: the pyfuse3 adapter, overlays at the original paths, host-owned paths, the daemon and keeper."""
