"""Taking snapshots: the walk, the chunker, the pipeline, which snapshot a name means (threads)."""
