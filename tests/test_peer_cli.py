"""protocol-peer refuses bad configurations with one clear line and a non-zero exit, no traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import traceback
from pathlib import Path

import pytest

from peer.cli import build_parser, main
from swarm.manifest import save_manifest
from swarm.presets import preset


def run_installed(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed `protocol-peer` command, as a user runs it."""
    return subprocess.run(
        ["protocol-peer", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def run_peer(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`protocol-peer`'s entry point run in this process with `env` added to the environment: its exit status and
    stderr. Every refusal below comes before the peer starts anything, so the command's own process adds only its
    imports (4 s a case on two cores); `--help`, an unreachable DHT and the signal tests run the installed command."""
    saved = dict(os.environ)
    stderr = io.StringIO()
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stderr(stderr):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's own refusals
                code = exit_.code
    except Exception:  # noqa: BLE001 - what a user would see as a traceback
        code = 1
        stderr.write("Traceback (most recent call last):\n" + traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["protocol-peer", *args], code, "", stderr.getvalue())


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    line = [ln for ln in result.stderr.splitlines() if ln.startswith("protocol-peer: error:")]
    assert len(line) == 1, result.stderr
    for needle in needles:
        assert needle in line[0], line[0]


@pytest.fixture()
def manifest_file(tmp_path: Path) -> Path:
    path = tmp_path / "manifest.json"
    save_manifest(preset("tiny", stages=3), path)
    return path


def test_help_documents_every_flag_and_its_environment_variable():
    result = run_installed("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for action in build_parser()._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag in (None, "--help") or action.help == "==SUPPRESS==":
            continue
        assert flag in text
        assert "PROTOCOL_PEER_" + flag[2:].replace("-", "_").upper() in text


def test_stage_out_of_range(manifest_file: Path):
    assert_one_line_error(
        run_peer("--new-swarm", "--manifest", str(manifest_file), "--stage", "3"), "--stage 3", "0..2"
    )


def test_stage_from_the_environment(manifest_file: Path):
    result = run_peer(
        env={"PROTOCOL_PEER_NEW_SWARM": "1", "PROTOCOL_PEER_MANIFEST": str(manifest_file), "PROTOCOL_PEER_STAGE": "7"}
    )
    assert_one_line_error(result, "--stage 7")


def test_manifest_hash_mismatch(tmp_path: Path):
    data = preset("tiny", stages=3).model_dump(mode="json")
    data["t_fixed_sha256"] = "ab" * 32
    path = tmp_path / "forged.json"
    path.write_text(json.dumps(data))
    assert_one_line_error(
        run_peer("--new-swarm", "--manifest", str(path), "--stage", "0"),
        "T_fixed hash mismatch",
        "abab",
        preset("tiny", stages=3).t_fixed_sha256,
    )


def test_lane_out_of_range_or_without_context_parallelism(tmp_path: Path, manifest_file: Path):
    assert_one_line_error(
        run_peer("--new-swarm", "--manifest", str(manifest_file), "--lane", "1"), "--lane 1", "no context parallelism"
    )
    long = tmp_path / "long.json"
    save_manifest(preset("tiny-long"), long)  # context_parallel.size 4
    assert_one_line_error(run_peer("--new-swarm", "--manifest", str(long), "--lane", "4"), "--lane 4", "0..3")
    assert_one_line_error(
        run_peer(env={"PROTOCOL_PEER_NEW_SWARM": "1", "PROTOCOL_PEER_MANIFEST": str(long), "PROTOCOL_PEER_LANE": "x"}),
        "--lane must be 'auto' or a number",
    )


def test_a_cp_warm_up_peers_do_not_run_is_refused(tmp_path: Path):
    warm = tmp_path / "warm.json"
    save_manifest(preset("tiny-long", context_parallel={"warm_start_steps": 2}), warm)  # compressed, size 4
    assert_one_line_error(run_peer("--new-swarm", "--manifest", str(warm)), "warm_start_steps is 2", "no dense K/V")


def test_min_stream_rate_must_be_positive(manifest_file: Path):
    for value in ("0", "-5", "nan"):
        assert_one_line_error(
            run_peer("--new-swarm", "--manifest", str(manifest_file), "--min-stream-kbit", value), "--min-stream-kbit"
        )


def test_audit_rate_must_be_a_share(manifest_file: Path):
    for value in ("-0.1", "1.5", "nan"):
        assert_one_line_error(
            run_peer("--new-swarm", "--manifest", str(manifest_file), "--audit-rate", value), "--audit-rate", "0..1"
        )


def test_needs_a_way_in(manifest_file: Path):
    assert_one_line_error(run_peer("--manifest", str(manifest_file)), "initial peers")
    assert_one_line_error(run_peer(), "--tracker")


def test_unreachable_tracker(manifest_file: Path):
    assert_one_line_error(run_peer("--tracker", "http://127.0.0.1:9/"), "cannot reach the tracker")


@pytest.mark.slow
def test_unreachable_initial_peers(manifest_file: Path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmcRYxWgW4Bj6vz6zzdRR6zFeZVUdHVRsNfLsSbo2xrNhB"
    assert_one_line_error(
        run_installed(
            "--manifest",
            str(manifest_file),
            "--initial-peers",
            dead,
            "--stage",
            "0",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
        ),
        "could not join the DHT",
    )


def live_processes_in_group(pgid: int) -> list[str]:
    """Processes of a process group that are not zombies (a zombie is only waiting to be reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(stat[: stat.rindex(")") + 1])
    return found


def start_lone_peer(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path]:
    """A one-stage run's only peer (its driver is its tail) in a process group of its own, as a terminal
    or systemd would start it; returns once it is online and training."""
    import time

    manifest = tmp_path / "manifest.json"
    save_manifest(preset("tiny", stages=1), manifest)
    log, checkpoints = tmp_path / "peer.log", tmp_path / "checkpoints"
    with log.open("wb") as handle:
        process = subprocess.Popen(
            ["protocol-peer", "--new-swarm", "--manifest", str(manifest), "--stage", "0", "--device", "cpu",
             "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(checkpoints), "--log-interval", "1"],
            stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    deadline = time.monotonic() + 120
    while b"trips 1" not in log.read_bytes().replace(b"trips 0", b""):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return process, log, checkpoints


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_whole_process_group_ends_the_peer_cleanly(tmp_path: Path, stop: str):
    """Ctrl-C signals the terminal's foreground group, systemd's default KillMode the service's group: the
    peer leaves its stage, saves its checkpoint and exits within 30 s, and nothing of it keeps running."""
    import signal
    import time

    process, log, checkpoints = start_lone_peer(tmp_path)
    try:
        os.killpg(process.pid, getattr(signal, stop))
        started = time.monotonic()
        code = process.wait(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        if process.poll() is None or live_processes_in_group(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "left the stage" in text
    assert list(checkpoints.rglob("stage0.pt")), text[-3000:]
    assert live_processes_in_group(process.pid) == [], "the DHT process or p2pd outlived the peer"
    print(f"{stop} to the group: exited in {elapsed:.1f}s")


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(tmp_path: Path):
    import signal
    import time

    process, log, _ = start_lone_peer(tmp_path)
    try:
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        started = time.monotonic()
        code = process.wait(timeout=10)
        elapsed = time.monotonic() - started
    finally:
        if process.poll() is None or live_processes_in_group(process.pid):
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 130, log.read_text()[-3000:]
    assert elapsed < 5
    time.sleep(1.0)
    assert live_processes_in_group(process.pid) == []
