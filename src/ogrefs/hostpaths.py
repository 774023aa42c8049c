"""Host-owned paths: what always comes from the box a snapshot is mounted on (placeholder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class HostLayer:
    overlays: list
    kept: list[str] = field(default_factory=list)

    def run_ldconfig(self) -> str:
        return "not needed"


def prepare(overlays: list, state_dir: Path, host_paths: Any) -> HostLayer:
    return HostLayer(list(overlays))
