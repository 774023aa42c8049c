"""The file system the kernel sees, protocol-free: inodes, reads, listings, what is pushed to the kernel."""
