"""What a peer is told at start (`protocol-peer`'s flags, `peer/cli.py`), as one value the daemon reads."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from p2pio.budget import Budget
from p2pio.framing import MIN_RATE
from peer.audit import AUDIT_RATE
from peer.placement import Hysteresis
from peer.stage_averagers import GradientWire


@dataclass
class PeerOptions:
    stage: str = "auto"
    lane: int | None = None  # None: chosen with the stage (peer/lanes.py); a number: pinned by --lane
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: str | None = None
    device: str = "auto"
    public_name: str = ""
    checkpoint_dir: str | None = None
    max_inflight: int | None = None  # trips a driver keeps in flight; None: the trip flavour's `default_inflight`
    data: str | None = None
    trip_timeout: float = 60.0
    min_stream_rate: float = MIN_RATE  # bytes/s every incoming trip or K/V stream must keep (p2pio/framing.py)
    placement_delay: float = 3.0
    rebalance_interval: float = 60.0
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    drain_timeout: float = 30.0
    log_interval: float = 5.0
    fault_t_fixed_seed: int | None = None
    fault_cp_version: int | None = None  # a peer that claims another CP basis version (its K/V are refused)
    fault_poison_served_state: bool = False  # a hostile state donor (peer/stage_averagers.py PoisonedStateDonor)
    gradient_wire: GradientWire = GradientWire.FP16  # what the stage's gradient averaging sends (--grad-averaging)
    audit_rate: float = AUDIT_RATE  # share of a verified next-hop peer's trips duplicated to another (peer/audit.py)
    checkpoint_every: int = 50
    heartbeat_file: str | None = None
    relay: str = "auto"  # peer/reachability.py `relay_options`
    relay_service: bool = True  # carry circuits for NATed peers, within `relay_budget`
    relay_budget: Budget = field(default_factory=Budget)  # what --relay-service carries (p2pd's per-circuit budget)


def pick_device(requested: str) -> torch.device:
    """The torch device `--device` names (`auto`: CUDA when there is one); refuses CUDA where there is none."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA device is available")
    return torch.device(requested)
