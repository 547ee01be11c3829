"""protocol-peer refuses bad configurations with one clear line and a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from peer.cli import build_parser
from swarm.manifest import save_manifest
from swarm.presets import preset


def run_peer(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["protocol-peer", *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


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
    result = run_peer("--help")
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


def test_needs_a_way_in(manifest_file: Path):
    assert_one_line_error(run_peer("--manifest", str(manifest_file)), "initial peers")
    assert_one_line_error(run_peer(), "--tracker")


def test_unreachable_tracker(manifest_file: Path):
    assert_one_line_error(run_peer("--tracker", "http://127.0.0.1:9/"), "cannot reach the tracker")


@pytest.mark.slow
def test_unreachable_initial_peers(manifest_file: Path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/QmcRYxWgW4Bj6vz6zzdRR6zFeZVUdHVRsNfLsSbo2xrNhB"
    assert_one_line_error(
        run_peer(
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
