"""What one run's process asks of the machine it runs on, as Kubernetes quantities."""

from __future__ import annotations

import re
from dataclasses import dataclass

_CPU_QUANTITY = re.compile(r"^(\d+m|\d+(\.\d+)?)$")  # millicores (250m) or cores (0.5, 2)
_MEMORY_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi)$")
_MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def memory_bytes(quantity: str) -> int:
    """Bytes in a memory quantity written the Kubernetes way with a binary unit (``512Mi``)."""
    match = _MEMORY_QUANTITY.match(quantity)
    if not match:
        raise ValueError(
            f"memory must be a whole number of Ki, Mi or Gi (e.g. 512Mi), not {quantity!r}"
        )
    return int(match.group(1)) * _MEMORY_UNITS[match.group(2)]


@dataclass(frozen=True)
class RunResources:
    """What one run's process asks of the machine it runs on, as Kubernetes quantities. That
    is the CPU and memory it is guaranteed, and the memory it may not exceed. The Kubernetes
    run launcher makes them the run pod's resources, and other launchers ignore them. There
    is no CPU limit on purpose, because a throttled batch only holds its row locks longer."""

    cpu_request: str = "250m"
    memory_request: str = "512Mi"  # a run worker loads Dagster and the whole code location
    memory_limit: str = "1Gi"

    def __post_init__(self) -> None:
        if not _CPU_QUANTITY.match(self.cpu_request):
            raise ValueError(
                f"cpu_request must be millicores or cores (e.g. 250m, 1), not {self.cpu_request!r}"
            )
        if memory_bytes(self.memory_request) > memory_bytes(self.memory_limit):
            raise ValueError(
                f"memory_request {self.memory_request} exceeds memory_limit {self.memory_limit}"
            )
