"""Operations on a repository's snapshots: check, diff, forget, prune, repack, copy, browse (threads)."""
