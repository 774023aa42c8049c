"""The agent that keeps a box protected: snapshots on a schedule, on new checkpoints, on preemption notices.

Modules: :mod:`.loop` (the agent: triggers, one snapshot at a time, retention,
status), :mod:`.watch` (new coherent checkpoints), :mod:`.notices` (AWS, GCP,
Azure preemption notices).  The command line is in :mod:`ogrefs.cli.agent`.
"""
