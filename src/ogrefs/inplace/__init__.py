"""Writing a snapshot into place on this box's own disk: the resume where FUSE and mounts are not allowed.

``engine`` the priority-ordered, resumable write-in-place (threads, beside ``restore``) · ``kept`` what this
box already has, proven by chunk id, kept instead of fetched.
"""
