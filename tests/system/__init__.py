"""Tier 4: real FUSE mounts, overlayfs, private mount namespaces, the SeaweedFS S3 server, debootstrap'd Debian roots."""
