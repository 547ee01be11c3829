"""Tracker logic without a network: summary rules, history store, metrics, CLI env, HTTP layer.

The HTTP tests run the real FastAPI app on a real `SwarmMonitor`; only the DHT read is replaced
by a function returning real, schema-valid `StagePeerRecord`s (the DHT itself is exercised in
test_tracker_swarm.py).
"""

from __future__ import annotations

import hashlib
import math
import socket

import multihash
import pytest
from builders import stage_record
from fastapi.testclient import TestClient
from hivemind.p2p import PeerID
from prometheus_client.parser import text_string_to_metric_families

from swarm.manifest import save_manifest
from swarm.presets import preset
from swarm.records import PeerEntry, StagePeerRecord, plausible_loss_bound, plausible_throughput
from tracker.app import create_app
from tracker.cli import build_parser, default_host_maddrs, main
from tracker.history import History, with_rates
from tracker.metrics import make_registry, render
from tracker.rejoin_addrs import dialable_addrs
from tracker.service import SwarmMonitor
from tracker.summary import (
    MAX_PEERS_LISTED,
    MAX_PEERS_PER_STAGE,
    TOKENS_SLACK_S,
    PeerView,
    boundary_directions,
    credited_tokens,
    current_u_version,
    peers_listed_per_stage,
    summarize,
    track_last_seen,
    weighted_median,
)

MANIFEST = preset("tiny", stages=3)
NOW = 1_800_000_000.0
XSS_SCRIPT = "<script>window.__xss=1</script>"
XSS_IMG = "<img src=x onerror=window.__xss=1>"


def record(stage: int, name: str = "peer", **changes) -> StagePeerRecord:
    return stage_record(stage, name, MANIFEST, **changes)


def view(rec: StagePeerRecord, last_seen: float = NOW, owner: bytes | None = None) -> PeerView:
    return PeerView(rec, NOW + 20, owner or f"[owner:{rec.peer_id}]".encode(), last_seen)


def full_swarm(**stage_changes) -> dict[int, list[PeerView]]:
    return {i: [view(record(i, f"s{i}", **stage_changes.get(f"s{i}", {})))] for i in range(3)}


def codes(summary: dict) -> list[tuple[str, int | None]]:
    return [(w["code"], w["stage"]) for w in summary["warnings"]]


# --- summary rules ---


def test_empty_swarm_is_unhealthy_with_one_warning_per_stage():
    s = summarize(MANIFEST, {}, NOW)
    assert s["healthy"] is False
    assert codes(s) == [("empty_stage", 0), ("empty_stage", 1), ("empty_stage", 2)]
    assert s["u_version"] == 0 and s["totals"]["loss"] is None and s["totals"]["compression_ratio"] is None


def test_before_first_poll_the_verdict_is_unhealthy():
    s = summarize(MANIFEST, full_swarm(), NOW, polled=False)
    assert s["healthy"] is False and ("no_data", None) in codes(s)


def test_every_stage_online_is_healthy_and_capacity_is_the_bottleneck():
    stages = full_swarm()
    stages[1].append(view(record(1, "extra", throughput=50.0)))
    stages[2][0] = view(record(2, "slow", throughput=30.0))
    s = summarize(MANIFEST, stages, NOW)
    assert s["healthy"] is True and s["warnings"] == []
    assert [row["peers_online"] for row in s["stages"]] == [1, 2, 1]
    # only stage 1 has a second peer to audit the first against; a lone peer is trusted on first use
    assert [row["audited"] for row in s["stages"]] == [False, True, False]
    assert [row["throughput"] for row in s["stages"]] == [100.0, 150.0, 30.0]
    assert s["totals"]["capacity_tokens_per_s"] == 30.0


@pytest.mark.parametrize("state", ["joining", "leaving"])
def test_a_stage_without_an_online_peer_makes_the_swarm_unhealthy(state):
    s = summarize(MANIFEST, full_swarm(s1={"state": state}), NOW)
    assert s["healthy"] is False
    assert ("empty_stage", 1) in codes(s)
    assert s["stages"][1]["peers_total"] == 1 and s["stages"][1]["peers_online"] == 0


def test_a_peer_with_another_t_fixed_does_not_count_and_is_flagged():
    s = summarize(MANIFEST, full_swarm(s2={"t_fixed_sha256": "ab" * 32}), NOW)
    assert s["healthy"] is False
    assert ("t_fixed_mismatch", 2) in codes(s) and ("empty_stage", 2) in codes(s)


def test_u_hash_mismatch_and_version_lag_are_flagged():
    stages = full_swarm(s0={"u_sha256": "cd" * 32}, s2={"u_version": 2, "u_sha256": "ef" * 32})
    s = summarize(MANIFEST, stages, NOW)
    assert s["u_version"] == 2
    assert ("u_hash_mismatch", 0) in codes(s)
    assert ("u_version_behind", 0) in codes(s) and ("u_version_behind", 1) in codes(s)
    assert ("u_version_behind", 2) not in codes(s)
    assert s["healthy"] is True  # lagging peers still serve; the warning is the signal


def test_current_u_version_ignores_peers_that_are_not_online():
    stages = full_swarm(s1={"state": "joining", "u_version": 9})
    assert current_u_version(stages) == 0
    assert current_u_version({}) == 0


def test_stale_peer_is_flagged_but_still_counted():
    stages = full_swarm()
    stages[0][0] = view(record(0, "old"), last_seen=NOW - 60)
    s = summarize(MANIFEST, stages, NOW, stale_after=25)
    assert ("stale_peer", 0) in codes(s) and s["healthy"] is True
    assert s["stages"][0]["peers"][0]["seconds_since_seen"] == 60


def test_software_version_difference_is_informational():
    s = summarize(MANIFEST, full_swarm(s1={"software_version": "9.9.9"}), NOW)
    assert [w["level"] for w in s["warnings"]] == ["info"] and s["healthy"] is True


def test_traffic_totals_compare_with_dense_per_boundary_direction():
    assert [boundary_directions(i, 3) for i in range(3)] == [1, 2, 1]
    assert boundary_directions(0, 1) == 0
    stages = full_swarm(
        s0={"tokens": 1000, "bytes_out": 5000},
        s1={"tokens": 1000, "bytes_out": 9000},
        s2={"tokens": 1000, "bytes_out": 4000},
    )
    s = summarize(MANIFEST, stages, NOW)
    dense = MANIFEST.dense_bytes_per_token()
    assert s["totals"]["bytes_sent"] == 18000
    assert s["totals"]["dense_equivalent_bytes"] == 1000 * dense * 4
    assert s["totals"]["compression_ratio"] == pytest.approx(18000 / (4000 * dense))
    assert s["totals"]["tokens_trained"] == 1000  # counted at stage 0 only: every trip starts there
    assert s["totals"]["manifest_bytes_ratio"] == MANIFEST.compressed_bytes_per_token() / dense


def test_loss_is_the_token_weighted_median_over_online_drivers():
    stages = full_swarm(s0={"loss": 2.0, "tokens": 300})
    stages[0].append(view(record(0, "b", loss=4.0, tokens=100)))
    stages[0].append(view(record(0, "gone", loss=100.0, tokens=100, state="leaving")))
    s = summarize(MANIFEST, stages, NOW)
    assert s["totals"]["loss"] == pytest.approx(2.0)
    stages[0].append(view(record(0, "c", loss=5.0, tokens=300)))
    assert summarize(MANIFEST, stages, NOW)["totals"]["loss"] == pytest.approx(4.0)  # 700 tokens: median at 350


def test_weighted_median():
    assert weighted_median([]) is None
    assert weighted_median([(3.0, 1.0)]) == 3.0
    assert weighted_median([(1.0, 1.0), (2.0, 1.0), (9.0, 1.0)]) == 2.0
    assert weighted_median([(1.0, 0.0), (2.0, 5.0)]) == 2.0


def test_a_huge_token_claim_is_clamped_to_plausible_hardware_over_the_time_seen():
    bound = plausible_throughput(MANIFEST, 0)
    assert credited_tokens(1000, bound, seen_for=0.0) == 1000  # honest counts are far below the bound
    assert credited_tokens(10**18, bound, seen_for=100.0) == int(bound * (100.0 + TOKENS_SLACK_S))
    assert credited_tokens(-5, bound, seen_for=10.0) == 0
    honest = [view(record(0, f"h{i}", loss=3.0, tokens=50_000)) for i in range(3)]
    liar = view(record(0, "liar", loss=0.01, tokens=10**18), owner=b"liar")
    s = summarize(MANIFEST, {0: [*honest, liar]}, NOW)
    assert s["totals"]["tokens_trained"] <= 150_000 + bound * TOKENS_SLACK_S  # first seen just now
    assert s["totals"]["loss"] == pytest.approx(3.0)  # clamped tokens: the liar cannot set the loss
    # seen for an hour, the liar would weigh more; a weighted median still needs half of all tokens
    old = PeerView(liar.record, liar.expiration, liar.owner, NOW, first_seen=NOW - 3600)
    assert summarize(MANIFEST, {0: [*honest, old]}, NOW)["totals"]["tokens_trained"] <= 150_000 + bound * 3660


def test_a_loss_outside_the_plausible_bound_is_ignored():
    bound = plausible_loss_bound(MANIFEST)
    stages = full_swarm(s0={"loss": 3.0, "tokens": 100})
    stages[0].append(view(record(0, "high", loss=bound + 1, tokens=10_000)))
    stages[0].append(view(record(0, "neg", loss=-1.0, tokens=10_000)))
    assert summarize(MANIFEST, stages, NOW)["totals"]["loss"] == pytest.approx(3.0)


def test_untrusted_strings_pass_through_verbatim_in_json():
    stages = full_swarm(s0={"public_name": XSS_SCRIPT}, s1={"public_name": XSS_IMG})
    s = summarize(MANIFEST, stages, NOW)
    assert s["stages"][0]["peers"][0]["public_name"] == XSS_SCRIPT
    assert s["stages"][1]["peers"][0]["public_name"] == XSS_IMG


def test_peer_lists_are_bounded():
    crowd = [view(record(0, f"p{i}"), owner=f"o{i}".encode()) for i in range(MAX_PEERS_PER_STAGE + 44)]
    s = summarize(MANIFEST, {0: crowd}, NOW)
    row = s["stages"][0]
    assert len(row["peers"]) == MAX_PEERS_PER_STAGE and row["peers_omitted"] == 44
    assert row["peers_total"] == MAX_PEERS_PER_STAGE + 44
    assert peers_listed_per_stage(32) * 32 <= MAX_PEERS_LISTED and peers_listed_per_stage(10**6) == 8


CP2 = preset("tiny", stages=2, context_parallel={"size": 2})


def lane_view(stage: int, lane: int, name: str, throughput: float = 100.0, **changes) -> PeerView:
    return view(stage_record(stage, name, CP2, lane=lane, throughput=throughput, **changes))


def test_lanes_per_stage_and_capacity_is_the_weakest_lane():
    stages = {
        0: [lane_view(0, 0, "a", 100.0), lane_view(0, 0, "b", 50.0), lane_view(0, 1, "c", 120.0)],
        1: [lane_view(1, 0, "d", 300.0), lane_view(1, 1, "e", 200.0)],
    }
    s = summarize(CP2, stages, NOW)
    assert s["healthy"] and s["lanes"] == 2
    # a lane is audited by forks to a second peer of the lane: stage 0's lane 1 and stage 1 have one each
    assert not any(row["audited"] for row in s["stages"])
    stages[0].append(lane_view(0, 1, "f", 10.0))
    assert [row["audited"] for row in summarize(CP2, stages, NOW)["stages"]] == [True, False]
    assert [(lane["peers_serving"], lane["throughput"], lane["empty"]) for lane in s["stages"][0]["lanes"]] == [
        (2, 150.0, False),
        (1, 120.0, False),
    ]
    assert [row["throughput"] for row in s["stages"]] == [120.0, 200.0]
    assert s["totals"]["capacity_tokens_per_s"] == 120.0
    assert [p["lane"] for p in s["stages"][1]["peers"]] == [0, 1]


def test_an_empty_lane_stalls_the_swarm_and_a_bad_lane_claim_serves_nothing():
    stages = {
        0: [lane_view(0, 0, "a"), lane_view(0, 1, "b")],
        1: [lane_view(1, 0, "c"), lane_view(1, 2, "liar", 1e6)],  # lane 2 of 2: a bad claim fills no lane
    }
    s = summarize(CP2, stages, NOW)
    assert not s["healthy"]
    assert s["stages"][1]["empty_lanes"] == [1] and s["stages"][0]["empty_lanes"] == []
    assert s["stages"][1]["throughput"] == 0.0 and s["totals"]["capacity_tokens_per_s"] == 0.0
    assert ("empty_lane", 1) in codes(s) and ("bad_lane", 1) in codes(s)
    assert s["stages"][1]["peers_serving"] == 1


def test_without_context_parallelism_only_lane_0_serves_and_rows_list_no_lanes():
    s = summarize(MANIFEST, full_swarm(s1={"lane": 1}), NOW)
    assert s["lanes"] == 1 and "lanes" not in s["stages"][0]
    assert not s["healthy"] and ("bad_lane", 1) in codes(s) and ("empty_stage", 1) in codes(s)


def test_last_seen_moves_only_when_a_record_is_refreshed():
    a = PeerEntry(record(0, "a"), expiration=NOW + 30, owner=b"a")
    b = PeerEntry(record(1, "b"), expiration=NOW + 30, owner=b"b")
    seen = track_last_seen({}, [a, b], NOW)
    assert seen == {b"a": (NOW + 30, NOW, NOW), b"b": (NOW + 30, NOW, NOW)}
    a2 = PeerEntry(a.record, expiration=NOW + 40, owner=b"a")
    seen = track_last_seen(seen, [a2, b], NOW + 10)
    assert seen == {b"a": (NOW + 40, NOW + 10, NOW), b"b": (NOW + 30, NOW, NOW)}  # first seen stays
    assert track_last_seen(seen, [a2], NOW + 20) == {b"a": (NOW + 40, NOW + 10, NOW)}


# --- history ---


def sample(t: float, tokens: int = 0, loss: float | None = 3.0) -> dict:
    return dict(time=t, loss=loss, capacity=10.0, tokens=tokens, peers=3, bytes_sent=0)


def test_history_persists_and_downsamples(tmp_path):
    db = tmp_path / "h.sqlite"
    h = History(db, MANIFEST.run_id)
    for i in range(1000):
        h.add(sample(NOW + i, tokens=10 * i))
    h.close()
    h = History(db, MANIFEST.run_id)
    assert h.count() == 1000
    rows = h.read(100)
    assert len(rows) == 100
    assert rows[-1]["time"] == NOW + 999  # the newest sample is always included
    assert all(a["time"] < b["time"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[-1]["rate"] == pytest.approx(10.0)
    assert h.read(5000)[0]["time"] == NOW
    assert [r["time"] for r in h.read(10, since=NOW + 995)] == [NOW + t for t in range(995, 1000)]
    assert h.read(0) == []
    h.close()


def test_history_is_capped(tmp_path):
    h = History(tmp_path / "h.sqlite", MANIFEST.run_id, max_rows=50)
    for i in range(202):
        h.add(sample(NOW + i))
    assert h.count() <= 202 - 200 + 50
    h.close()


def test_rates_skip_counter_resets():
    rows = with_rates([sample(0, 0), sample(10, 100), sample(20, 5), sample(20, 6)], window=0)
    assert [r["rate"] for r in rows] == [None, 10.0, None, None]


def test_rates_are_smoothed_over_the_window():
    # counters move every 2 s, polls come every 1 s: consecutive deltas would read 0, 100, 0, 100...
    rows = with_rates([sample(t, 100 * (t // 2)) for t in range(40)], window=10)
    assert all(r["rate"] == pytest.approx(50, abs=6) for r in rows[11:])


# --- metrics ---


def test_metrics_are_prometheus_text_with_bounded_labels():
    stages = full_swarm(s0={"public_name": XSS_SCRIPT, "loss": 2.0})
    s = summarize(MANIFEST, stages, NOW)
    stats = {"polls": 3, "poll_failures": 1, "last_poll_age": 0.5}
    text = render(make_registry(lambda: s, lambda: stats)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["protocol_swarm_healthy"].samples[0].value == 1
    assert families["protocol_swarm_loss"].samples[0].value == 2.0
    peers = families["protocol_swarm_stage_peers"].samples
    online = {(x.labels["stage"], x.labels["state"]): x.value for x in peers}
    assert online[("0", "online")] == 1 and online[("2", "joining")] == 0
    assert families["protocol_tracker_poll_failures"].samples[0].value == 1
    assert "script" not in text


# --- CLI ---


def test_cli_flags_come_from_env_and_the_command_line_wins(monkeypatch):
    monkeypatch.setenv("PROTOCOL_TRACKER_MANIFEST", "/m.json")
    monkeypatch.setenv("PROTOCOL_TRACKER_PORT", "9001")
    monkeypatch.setenv("PROTOCOL_TRACKER_INITIAL_PEERS", "/ip4/1.2.3.4/tcp/1/p2p/A, /ip4/1.2.3.4/tcp/2/p2p/B")
    monkeypatch.setenv("PROTOCOL_TRACKER_DB", "/data/h.sqlite")
    args = build_parser().parse_args([])
    assert args.manifest == "/m.json" and args.port == 9001 and args.db == "/data/h.sqlite"
    assert args.initial_peers == ["/ip4/1.2.3.4/tcp/1/p2p/A", "/ip4/1.2.3.4/tcp/2/p2p/B"]
    args = build_parser().parse_args(["--port", "8123", "--initial-peers"])
    assert args.port == 8123 and args.initial_peers == []


def test_cli_requires_a_manifest(monkeypatch, capsys):
    monkeypatch.delenv("PROTOCOL_TRACKER_MANIFEST", raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert "--manifest" in capsys.readouterr().err


def test_dht_listens_where_http_does_by_default():
    assert default_host_maddrs("127.0.0.1") == ["/ip4/127.0.0.1/tcp/0"]
    assert default_host_maddrs("0.0.0.0") == ["/ip4/0.0.0.0/tcp/0"]


# --- HTTP layer on a real app ---


@pytest.fixture
def app_client(tmp_path):
    stages = {
        0: [PeerEntry(record(0, XSS_SCRIPT, loss=3.0, tokens=100), NOW + 1e9, b"a")],
        1: [PeerEntry(record(1, XSS_IMG), NOW + 1e9, b"b")],
        2: [PeerEntry(record(2, "ok"), NOW + 1e9, b"c")],
    }
    state = {"fail": False}

    def fetch():
        if state["fail"]:
            raise TimeoutError("DHT did not answer")
        return stages

    history = History(tmp_path / "h.sqlite", MANIFEST.run_id)
    monitor = SwarmMonitor(MANIFEST, history, fetch, bootstrap=lambda: ["/ip4/127.0.0.1/tcp/1/p2p/QmTracker"])
    monitor.poll_once()
    with TestClient(create_app(monitor), raise_server_exceptions=False) as client:
        yield client, monitor, state
    history.close()


def test_run_and_bootstrap_keep_their_shapes(app_client):
    client, _, _ = app_client
    run = client.get("/api/v1/run").json()
    assert run["manifest"] == MANIFEST.model_dump(mode="json") and run["run_id"] == MANIFEST.run_id
    assert run["t_fixed_sha256"] == MANIFEST.t_fixed_sha256 and run["u_version"] == 0
    assert client.get("/api/v1/bootstrap").json()["initial_peers"] == ["/ip4/127.0.0.1/tcp/1/p2p/QmTracker"]


def test_swarm_endpoint_and_query_validation(app_client):
    client, _, _ = app_client
    body = client.get("/api/v1/swarm").json()
    assert body["healthy"] is True and len(body["history"]) == 1
    assert body["stages"][0]["peers"][0]["public_name"] == XSS_SCRIPT
    for bad in ("history=-1", "history=100000", "history=abc", "since=nan", "since=-5", "since=inf"):
        assert client.get(f"/api/v1/swarm?{bad}").status_code == 422, bad
    assert client.get("/api/v1/swarm?history=0").json()["history"] == []
    for path in ("/nope", "/api/v1", "/api/v2/run", "/static/nope.js", "/static/../cli.py"):
        assert client.get(path).status_code == 404, path
    assert client.post("/api/v1/run").status_code == 405


def test_page_escapes_peer_names_and_forbids_inline_script(app_client):
    client, _, _ = app_client
    page = client.get("/")
    assert page.status_code == 200
    assert XSS_SCRIPT not in page.text and XSS_IMG not in page.text
    assert "&lt;script&gt;window.__xss=1&lt;/script&gt;" in page.text
    assert "&lt;img src=x onerror=window.__xss=1&gt;" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert client.get("/static/tracker.js").status_code == 200
    assert client.get("/static/tracker.css").status_code == 200


def test_page_names_the_relay_of_a_relayed_peer(tmp_path):
    relay = PeerID(multihash.encode(hashlib.sha256(b"a relay").digest(), "sha2-256")).to_base58()
    stages = {i: [PeerEntry(record(i, f"s{i}"), NOW + 1e9, b"x")] for i in range(3)}
    stages[1] = [PeerEntry(record(1, "home", reachability="via relay", relay=relay), NOW + 1e9, b"y")]
    history = History(tmp_path / "h.sqlite", MANIFEST.run_id)
    monitor = SwarmMonitor(MANIFEST, history, lambda: stages, bootstrap=lambda: [])
    monitor.poll_once()
    with TestClient(create_app(monitor)) as client:
        page = client.get("/").text
        peer = client.get("/api/v1/swarm").json()["stages"][1]["peers"][0]
    history.close()
    assert f'title="through relay {relay}">via relay<' in page
    assert (peer["reachability"], peer["relay"]) == ("via relay", relay)


def test_page_shows_lanes_and_marks_empty_ones_only_with_context_parallelism(tmp_path, app_client):
    client, _, _ = app_client
    assert "Lane" not in client.get("/").text
    entries = {
        0: [PeerEntry(stage_record(0, XSS_SCRIPT, CP2, lane=1), NOW + 1e9, b"a")],
        1: [PeerEntry(stage_record(1, "b", CP2, lane=0), NOW + 1e9, b"b")],
    }
    history = History(tmp_path / "lanes.sqlite", CP2.run_id)
    monitor = SwarmMonitor(CP2, history, lambda: entries, bootstrap=lambda: [])
    monitor.poll_once()
    with TestClient(create_app(monitor)) as lanes_client:
        page = lanes_client.get("/").text
    history.close()
    assert "<th>Lane</th>" in page and "<th>Lanes (serving peers)</th>" in page
    assert '<span class="lane empty" data-lane="0">0: empty</span>' in page
    assert '<span class="lane ok" data-lane="1">1: 1</span>' in page
    assert '<td class="lane">1</td>' in page
    assert XSS_SCRIPT not in page and "&lt;script&gt;window.__xss=1&lt;/script&gt;" in page


def test_a_failing_dht_keeps_the_tracker_serving(app_client):
    client, monitor, state = app_client
    state["fail"] = True
    monitor.poll_once()
    body = client.get("/api/v1/swarm").json()
    assert body["healthy"] is False and body["warnings"][0]["code"] == "poll_failed"
    assert [row["peers_total"] for row in body["stages"]] == [1, 1, 1]  # last known state is kept
    assert client.get("/").status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["protocol_tracker_poll_failures"].samples[0].value == 1
    assert client.get("/healthz").json()["swarm_healthy"] is False
    state["fail"] = False
    monitor.poll_once()
    assert client.get("/api/v1/swarm").json()["healthy"] is True


def test_metrics_endpoint_parses(app_client):
    client, _, _ = app_client
    response = client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert {"protocol_swarm_healthy", "protocol_swarm_stage_peers", "protocol_tracker_polls"} <= names
    assert not math.isnan(next(iter(text_string_to_metric_families(response.text))).samples[0].value)


def test_an_internal_error_is_a_503_not_a_500(app_client):
    client, monitor, _ = app_client
    monitor.history.close()  # every history read now raises inside the handler
    response = client.get("/api/v1/swarm")
    assert response.status_code == 503 and response.json() == {"detail": "tracker error, try again"}
    assert client.get("/api/v1/run").status_code == 200


def test_only_plausible_peer_addresses_are_remembered():
    good = "/ip4/10.0.0.1/tcp/4000/p2p/12D3KooWgood"
    addrs = [
        good,
        "/ip4/10.0.0.2/tcp/1",
        "javascript:alert(1)",
        "/ip4/1.2.3.4/tcp/1/p2p/x y",
        "/ip4/127.0.0.1/tcp/9/p2p/QmSelf",
    ]
    stages = {0: [view(record(0, "a", addrs=addrs))], 1: [view(record(1, "b", addrs=[good], state="joining"))]}
    assert dialable_addrs(stages, exclude_peer_id="QmSelf") == [good]


def test_cli_env_values_are_validated_like_flags(monkeypatch, capsys):
    monkeypatch.setenv("PROTOCOL_TRACKER_PORT", "eighty")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--manifest", "m.json"])
    assert "invalid int value: 'eighty'" in capsys.readouterr().err


def test_cli_refuses_a_bad_manifest_or_a_taken_port_cleanly(tmp_path):
    assert main(["--manifest", str(tmp_path / "missing.json"), "--db", str(tmp_path / "h.sqlite")]) == 2
    (tmp_path / "bad.json").write_text('{"name": "x"}')
    assert main(["--manifest", str(tmp_path / "bad.json")]) == 2
    save_manifest(MANIFEST, tmp_path / "m.json")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["--manifest", str(tmp_path / "m.json"), "--port", str(port)]) == 2
    assert not (tmp_path / "h.sqlite").exists()


def test_tracker_never_imports_the_peer_daemon():
    import ast
    from pathlib import Path

    import tracker

    for path in Path(tracker.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "peer" or n.startswith("peer.") for n in names), path


def test_throughput_is_a_claim_clamped_to_what_hardware_can_do():
    """A record claiming 1e12 tokens/s is shown, and counted in capacity, at the stage's plausible bound."""
    from swarm.records import plausible_throughput

    stages = {i: [view(record(i, "honest"))] for i in range(MANIFEST.num_stages)}
    stages[1].append(view(record(1, "liar", throughput=1e12)))
    s = summarize(MANIFEST, stages, now=NOW)
    bound = plausible_throughput(MANIFEST, 1)
    row = s["stages"][1]
    liar = next(p for p in row["peers"] if p["public_name"] == "liar")
    assert liar["claimed_throughput"] == liar["throughput"] == bound
    assert liar["claimed_throughput_raw"] == 1e12
    assert row["throughput"] == row["claimed_throughput"] == bound + 100.0 and row["throughput_bound"] == bound
    assert s["totals"]["capacity_tokens_per_s"] == 100.0  # the other stages' honest claims
