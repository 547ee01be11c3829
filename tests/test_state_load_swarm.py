"""A live stage with a hostile state donor: real peers, the joiner takes only what the stage vouches for."""

from __future__ import annotations

import os
import signal
from contextlib import suppress
from pathlib import Path

import pytest
from harness import entries_by_name, online, swarm_of, wait_for

from peer.processes import descendants
from swarm.presets import preset


def _driver_tokens(swarm) -> int:
    return sum(e.record.tokens for e in entries_by_name(swarm).values() if e.record.stage == 0)


def _served_hashes(entries: dict, name: str) -> set[str]:
    return {item.split(":")[1] for item in entries[name].record.served_states} if name in entries else set()


@pytest.mark.slow
def test_a_joiner_takes_the_state_its_stage_vouches_for_not_the_poisoned_one_asked_first():
    """Stage 1 has two honest peers and a hostile one (`--fault-poison-served-state`: it declares an epoch a
    million ahead and serves its parameters shifted by 0.5, noting that hash as served). A joiner downloads its
    state first and takes an honest peer's: one the records announce, or else the one the others agree with."""
    manifest = preset("tiny", stages=2)
    names = ["d0", "a1", "b1", "h1"]
    with swarm_of(manifest, name="poisoned-donor") as swarm:
        swarm.spawn_peer("d0", "0")
        swarm.spawn_peer("a1", "1")
        swarm.spawn_peer("b1", "1")
        # the hostile peer last: a peer joining a stage of one honest and one hostile peer cannot tell which state
        # is honest, and stays joining (the next test)
        wait_for(lambda: online(swarm, names[:3]), 180, "three honest peers online")
        swarm.spawn_peer("h1", "1", ["--fault-poison-served-state"])
        wait_for(lambda: online(swarm, names), 180, "four peers online")
        start = _driver_tokens(swarm)
        wait_for(lambda: _driver_tokens(swarm) > start + 2000, 180, "training through stage 1")
        swarm.spawn_peer("fresh", "1")
        found = wait_for(lambda: online(swarm, ["fresh"]), 240, "the joiner to come online")
        loaded = found["fresh"].record.loaded_state
        log = (swarm.workdir / "fresh.log").read_text()
        loads = [line for line in log.splitlines() if "peer.state_load" in line or "load state" in line]
        assert loaded, "the joiner took no state at all:\n" + "\n".join(loads)
        # it asked the hostile peer first (its record notes the poisoned copy it served) and did not take that
        poisoned = wait_for(lambda: _served_hashes(entries_by_name(swarm), "h1"), 30, "h1's served state")
        assert "took state" in log, log[-3000:]
        assert loaded.split(":")[1] not in poisoned
        # what it took is a state an honest peer served
        wait_for(lambda: loaded.split(":")[1] in _served_hashes(entries_by_name(swarm), "a1")
                 | _served_hashes(entries_by_name(swarm), "b1"), 30, "an honest peer's record to show the state")


def _averager_processes(pid: int) -> list[int]:
    """The peer's hivemind averagers (which serve its state): processes forked from it, as its DHT process is, but
    without the DHT's p2pd below them."""
    own = Path(f"/proc/{pid}/cmdline").read_bytes()
    forked = [c for c in descendants(pid) if Path(f"/proc/{c}/cmdline").read_bytes() == own]
    return [c for c in forked if not any(b"p2pd" in Path(f"/proc/{g}/cmdline").read_bytes() for g in descendants(c))]


@pytest.mark.slow
def test_a_joiner_stays_joining_until_it_takes_a_state_and_never_serves_the_seed_beside_the_stage():
    """Stage 1's only peer stays online but its averagers stop answering (SIGSTOP): the joiner's download takes
    nothing, so it stays joining (not online with the seed beside a trained peer) and tries again; once the
    averagers answer again it takes the stage's state and only then goes online. A second joiner stopped while it
    waits leaves without ever going online and writes no checkpoint of the seed."""
    manifest = preset("tiny", stages=2)
    with swarm_of(manifest, name="joiner-waits") as swarm:
        swarm.spawn_peer("d0", "0")
        donor = swarm.spawn_peer("a1", "1")
        wait_for(lambda: online(swarm, ["d0", "a1"]), 180, "two peers online")
        start = _driver_tokens(swarm)
        wait_for(lambda: _driver_tokens(swarm) > start + 2000, 180, "training through stage 1")
        stopped = _averager_processes(donor.process.pid)
        assert stopped, "found no averager process of a1"
        try:
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            swarm.spawn_peer("fresh", "1")
            quitter = swarm.spawn_peer("quitter", "1")
            log, quitter_log = swarm.workdir / "fresh.log", swarm.workdir / "quitter.log"
            for waiting in (log, quitter_log):
                wait_for(lambda w=waiting: w.exists() and "stays joining" in w.read_text(), 300,
                         f"{waiting.stem}'s refused load")
            entries = entries_by_name(swarm)
            assert "fresh" not in entries or entries["fresh"].record.state == "joining", entries["fresh"].record
            quitter.process.send_signal(signal.SIGTERM)
            assert quitter.process.wait(timeout=60) == 0, quitter_log.read_text()[-3000:]
            text = quitter_log.read_text()
            assert "stopped while joining" in text and " online: " not in text, text[-3000:]
            # checkpoints live under <checkpoint-dir>/<run id>/
            saved = list((swarm.workdir / "checkpoints" / "quitter").rglob("*.pt"))
            assert "checkpoint saved" not in text and not saved, (saved, text[-3000:])
        finally:
            for pid in stopped:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        found = wait_for(lambda: online(swarm, ["fresh"]), 240, "the joiner to come online")
        assert found["fresh"].record.loaded_state, log.read_text()[-3000:]
        assert "starting stage 1 from the seed" not in log.read_text()
