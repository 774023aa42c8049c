"""Work that yields to the application: the prefetch of traces, hints and the rest, the box's CPU as
background work sees it, the gate a snapshot of the box closes, and materialization of the local copy."""
