"""Issue 26: a hostile peer in a stage's gradient averaging, on real peers.

A 2-stage swarm (a driver, two honest tails, then tests/hostile_averager_peer.py as a third tail; every trip
duplicated, `--audit-rate 1`) trains while the hostile tail sends the stage's gradient rounds a forgery in place of
its gradients and serves its trips honestly, so that only the averaging can find it: NaN (`swarm/robust.py`
`refusal`, what no honest peer sends: banned in the first round with it), or 1e4 times its gradients (thousands of
clip radii out, `flagrant`: banned in the first round of three, since a pair judges nobody's distance). Each honest
tail's averager bans it (`peer/robust_averaging.py`); the two honest tails
then go on averaging with each other, their weights never non-finite, and nobody bans an honest peer. A sender of −g
is judged by its direction over rounds of three or more senders, which this swarm forms in few rounds (one try, 2 Dec
2026: 12–13 of each tail's 51–81 rounds, and one of the two honest tails banned it within 5 minutes): it is tested on
real hivemind averagers in tests/test_robust_averaging.py and measured in benchmarks/robust_stage.py."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from harness import online, swarm_of, wait_for

from swarm.presets import preset

REPO = Path(__file__).resolve().parent.parent
AVERAGING_BAN = re.compile(r"(?P<averager>\S+) banned peer (?P<peer>\S+) from averaging for \S+ s: (?P<why>.*)$")
AUDIT_BAN = re.compile(r"audit: replies of .* disagree \(.*\); (?P<peer>\S+) banned")
EPOCH = re.compile(r", epoch (\d+), trips ")
HONEST = ("honest-a", "honest-b")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("send, why", [("nan", "NaN or inf"), ("huge", "clip radii from the robust average")])
def test_a_tail_sending_forged_gradients_to_its_stages_averaging_is_banned_and_the_stage_trains_on(send: str, why: str):
    manifest = preset("tiny", stages=2)
    # every trip duplicated, so that all three tails carry trips (a tail the driver has not verified gets trips only
    # as duplicates) and reach each epoch together
    with swarm_of(manifest, extra_peer_args=["--audit-rate", "1"], name=f"hostile-averager-{send}") as swarm:
        swarm.spawn_peer("driver", "0")
        for name in HONEST:
            swarm.spawn_peer(name, "1")
        program = [sys.executable, str(REPO / "tests" / "hostile_averager_peer.py"), "--send", send]
        swarm.spawn_peer("hostile", "1", program=program)
        found = wait_for(lambda: online(swarm, ["driver", *HONEST, "hostile"]), 180, "the swarm online")
        ids = {name: entry.record.peer_id for name, entry in found.items()}
        logs = {child.name: child.log for child in swarm.children}

        def lines(name: str) -> list[str]:
            return logs[name].read_text(errors="replace").splitlines()

        def bans(name: str) -> list[re.Match]:
            return [m for m in map(AVERAGING_BAN.search, lines(name)) if m]

        def hostile_bans() -> dict[str, list[re.Match]] | None:
            """Each honest tail's bans of the hostile one from its gradient averaging; None until both have one."""
            by_name = {name: [m for m in bans(name) if m["peer"] == ids["hostile"] and "grad_averager" in m["averager"]]
                       for name in HONEST}
            return by_name if all(by_name.values()) else None

        banned = wait_for(hostile_bans, 300, "both honest tails to ban the hostile one from averaging")
        whys = [m["why"] for matches in banned.values() for m in matches]
        assert all(why in found_why for found_why in whys), whys
        assert any(f"hostile averager: sending {send}" in line for line in lines("hostile"))

        # after the bans the honest tails still average their gradients, with each other, and step on
        since = {name: len(lines(name)) for name in HONEST}
        epochs = {name: epoch(lines(name)) for name in HONEST}

        def trained_on() -> bool:
            return all(any("grad_averager averaged in a group of 2" in line for line in lines(name)[since[name]:])
                       and epoch(lines(name)) >= epochs[name] + 2 for name in HONEST)

        wait_for(trained_on, 180, "the honest tails to average their gradients again and step on")

        audit_banned = {m["peer"] for m in map(AUDIT_BAN.search, lines("driver")) if m}
        assert not audit_banned & {ids[name][-6:] for name in HONEST}, audit_banned
        for name in ("driver", *HONEST):
            assert not [m.string for m in bans(name) if m["peer"] != ids["hostile"]], name
            assert not [line for line in lines(name) if "refused non-finite updates" in line], name


def epoch(lines: list[str]) -> int:
    """The epoch a peer's last status line gives (-1 before its first)."""
    found = [int(m[1]) for m in map(EPOCH.search, lines) if m]
    return found[-1] if found else -1
