"""Tier 2: stores and repositories on disk, the real entry point (`python -m ogrefs`); no FUSE, no overlayfs, no S3 server needed beyond the s3-marked parameters."""
