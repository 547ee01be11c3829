"""How many trips a peer may hold at once, by memory (issue 27).

A trip keeps its graph, the activations autograd saved, at every stage it crossed until its gradient returns.
More trips in flight hide more delay (a trip waits a round trip per boundary crossed, twice) until the slowest
stage is busy, so a driver wants many; but a peer that holds more trips' activations than its memory has stops
with an out-of-memory error, and a hostile sender could push it there. The stage measures one trip's saved
tensors when it measures its throughput (`swarm/model.py` `PipelineStage.trip_activation_bytes`); these bound
the driver's window at stage 0 and the trips the trip server admits, each to a share of the memory free when
the slot came online (the rest is the optimizer's and hivemind's averagers' copies, and the system's).
"""

from __future__ import annotations

from pathlib import Path

import torch

DRIVER_SHARE = 0.25  # of the free memory: the trips this peer's driver keeps in flight (stage 0)
SERVED_SHARE = 0.5  # of the free memory: the trips of other peers this peer admits (`TripServer`)
CGROUP = Path("/sys/fs/cgroup")  # cgroup v2: a container's own limit, which /proc/meminfo does not show


def trips_that_fit(requested: int, trip_bytes: int, available: int | None, share: float) -> int:
    """`requested` trips, but no more than `share` of `available` bytes holds at `trip_bytes` each; at least one
    (a stage that fits one trip trains). Unbounded where nothing was measured or the memory is unknown."""
    if available is None or trip_bytes <= 0:
        return max(requested, 1)
    return max(1, min(requested, int(share * available) // trip_bytes))


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on `device` now, None where that cannot be read. An accelerator's free memory
    plus what PyTorch's allocator holds cached but unused; the host's MemAvailable, no more than its cgroup's
    limit leaves (a container)."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        free = int(fields["MemAvailable"].split()[0]) * 1024
        limit, used = CGROUP / "memory.max", CGROUP / "memory.current"
        if limit.exists() and used.exists() and (text := limit.read_text().strip()) != "max":
            free = min(free, int(text) - int(used.read_text()))
        return max(free, 0)
    except (OSError, KeyError, ValueError, IndexError, RuntimeError):
        return None
