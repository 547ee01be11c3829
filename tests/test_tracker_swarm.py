"""The real tracker (`python -m tracker`, a subprocess) against a real local swarm of DHT nodes.

Every "peer" is a separate hivemind DHT node that bootstraps from the tracker's
`/api/v1/bootstrap` and announces real owner-signed `StagePeerRecord`s with
`swarm.records.announce`. Two of them publish hostile public names. Tests run in file order
on one swarm: listing, metrics, the page in Chromium, a tracker restart, and last a stage
losing its only peer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import harness
import pytest
from builders import stage_record
from hivemind.dht import DHT
from hivemind.p2p import P2P
from prometheus_client.parser import text_string_to_metric_families

from dhtio.identity import load_identity_key
from dhtio.records import announce
from dhtio.validators import make_validators
from swarm.manifest import Manifest, save_manifest
from swarm.presets import preset
from swarm.records import StagePeerRecord

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
MANIFEST = preset("tiny", stages=3)
LANES_MANIFEST = preset("tiny", stages=2, context_parallel={"size": 2})  # 2 stages x 2 lanes
XSS_SCRIPT = "<script>window.__xss=1</script>"
XSS_IMG = "<img src=x onerror=window.__xss=1>"
CHROMIUM = "/usr/bin/chromium"
wait_for = functools.partial(harness.wait_for, interval=0.25)  # the tracker answers fast: poll often


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def get_json(url: str) -> dict:
    status, body = get(url)
    assert status == 200, (url, status, body[:300])
    return json.loads(body)


class Tracker:
    """`python -m tracker` in its own process group, so its DHT process and p2pd die with it."""

    def __init__(self, workdir: Path, dht_port: int) -> None:
        self.workdir, self.dht_port = workdir, dht_port
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.log = self.workdir / f"tracker-{self.starts}.log"
        cmd = [
            sys.executable,
            "-m",
            "tracker",
            "--manifest",
            str(self.workdir / "manifest.json"),
            "--port",
            "0",
            "--db",
            str(self.workdir / "history.sqlite"),
            "--identity",
            str(self.workdir / "tracker.id"),
            "--host-maddrs",
            f"/ip4/127.0.0.1/tcp/{self.dht_port}",
            "--poll-interval",
            "0.5",
        ]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"tracker exited with {self.proc.returncode}:\n{self.log.read_text()}")
            found = re.search(r"tracker ready at (http://127\.0\.0\.1:\d+)/", self.log.read_text())
            return found.group(1) if found else None

        self.url = wait_for(ready, 60, "the tracker's ready line")

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left in its group (DHT child, p2pd) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)


class FakePeer:
    """A real DHT node that announces one signed stage record every second, like a peer daemon."""

    def __init__(
        self, initial_peers: list[str], stage: int, name: str, ttl: float, manifest: Manifest = MANIFEST, **fields
    ) -> None:
        # records are signed with the libp2p identity key, so that their peer_id is the signer's
        self._identity_dir = tempfile.TemporaryDirectory(prefix="fake-peer-")
        identity = Path(self._identity_dir.name) / "identity.key"
        P2P.generate_identity(str(identity))
        self.manifest = manifest
        self.signer, validators = make_validators(manifest, load_identity_key(identity))
        self.dht = DHT(
            start=True,
            initial_peers=initial_peers,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            identity_path=str(identity),
            record_validators=validators,
        )
        self.stage, self.name, self.ttl, self.fields = stage, name, ttl, fields
        self.addrs = [str(a) for a in self.dht.get_visible_maddrs()]
        self.announcing = threading.Event()
        self.announcing.set()
        self.closed = threading.Event()
        self.count = 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def record(self) -> StagePeerRecord:
        fields = dict(
            peer_id=str(self.dht.peer_id),
            throughput=100.0 + 10 * self.stage,
            load=1,
            addrs=self.addrs,
            trips=self.count,
            tokens=1024 * self.count,
            bytes_out=100 * self.count,
            loss=(5.0 / (1 + 0.1 * self.count)) if self.stage == 0 else None,
        )
        return stage_record(self.stage, self.name, self.manifest, **{**fields, **self.fields})

    def _loop(self) -> None:
        while not self.closed.is_set():
            if self.announcing.is_set():
                try:
                    announce(self.dht, self.manifest, self.signer, self.record(), ttl=self.ttl)
                    self.count += 1
                except Exception:  # a failed store is retried on the next beat, like a real peer
                    pass
            self.closed.wait(1.0)

    def close(self) -> None:
        self.closed.set()
        if self.thread.is_alive():
            self.thread.join(timeout=10)
        self.dht.shutdown()
        self._identity_dir.cleanup()


def close_all(peers) -> None:
    """Shut peers down side by side: each DHT shutdown may wait seconds for its process."""
    threads = [threading.Thread(target=peer.close) for peer in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@contextlib.contextmanager
def tracked_swarm(workdir: Path, manifest: Manifest, specs: list[tuple]):
    """The tracker on `manifest` and a FakePeer per spec (key, stage, public name, record ttl, record fields),
    announcing; yields (tracker, peers by key, the tracker's bootstrap addresses)."""
    save_manifest(manifest, workdir / "manifest.json")
    tracker = Tracker(workdir, free_port())
    peers: dict[str, FakePeer] = {}
    try:
        tracker.start()
        bootstrap = get_json(tracker.url + "/api/v1/bootstrap")["initial_peers"]

        def make(key, stage, name, ttl, fields):
            peers[key] = FakePeer(bootstrap, stage, name, ttl, manifest=manifest, **fields)

        starting = [threading.Thread(target=make, args=spec) for spec in specs]
        for t in starting:
            t.start()
        for t in starting:
            t.join(timeout=60)
        assert sorted(peers) == sorted(spec[0] for spec in specs), "a peer's DHT node did not start"
        for peer in peers.values():
            peer.thread.start()
        yield tracker, peers, bootstrap
    finally:
        close_all(peers.values())
        tracker.stop()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    specs = [
        ("script", 0, XSS_SCRIPT, 8.0, {}),
        ("img", 1, XSS_IMG, 8.0, {}),
        ("plain", 1, "plain peer", 8.0, {}),
        ("last", 2, "only last stage", 3.0, {}),
    ]
    with tracked_swarm(tmp_path_factory.mktemp("tracker"), MANIFEST, specs) as (tracker, peers, _):
        yield tracker, peers


def stage_counts(url: str) -> list[int]:
    return [row["peers_total"] for row in get_json(url + "/api/v1/swarm")["stages"]]


def test_swarm_lists_every_stage_with_its_peers(swarm):
    tracker, peers = swarm
    wait_for(lambda: stage_counts(tracker.url) == [1, 2, 1], 30, "peers in every stage")
    body = wait_for(lambda: (b := get_json(tracker.url + "/api/v1/swarm?history=50"))["healthy"] and b, 10, "healthy")
    names = [sorted(p["public_name"] for p in row["peers"]) for row in body["stages"]]
    assert names == [[XSS_SCRIPT], sorted([XSS_IMG, "plain peer"]), ["only last stage"]]
    ids = {p["peer_id"] for row in body["stages"] for p in row["peers"]}
    assert ids == {str(peer.dht.peer_id) for peer in peers.values()}
    assert all(p["state"] == "online" and p["u_version"] == 0 for row in body["stages"] for p in row["peers"])
    assert body["totals"]["capacity_tokens_per_s"] == 100.0
    assert body["history"] and body["totals"]["loss"] is not None

    run = get_json(tracker.url + "/api/v1/run")
    assert run["manifest"] == MANIFEST.model_dump(mode="json") and run["run_id"] == MANIFEST.run_id
    assert run["u_sha256"] == MANIFEST.u_sha256 and run["u_version"] == 0
    assert get_json(tracker.url + "/healthz")["ok"] is True
    assert get(tracker.url + "/api/v1/swarm?history=-1")[0] == 422
    assert get(tracker.url + "/no/such/page")[0] == 404


def test_metrics_parse_as_prometheus_text(swarm):
    tracker, _ = swarm
    status, body = get(tracker.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert families["protocol_swarm_healthy"].samples[0].value == 1
    online = {
        s.labels["stage"]: s.value
        for s in families["protocol_swarm_stage_peers"].samples
        if s.labels["state"] == "online"
    }
    assert online == {"0": 1, "1": 2, "2": 1}
    assert families["protocol_tracker_polls"].samples[0].value >= 1


def rendered_page(browser, url: str, viewport: dict, **options):
    """The tracker's page at `url` once its script has drawn it, and the page errors it raises meanwhile."""
    page = browser.new_page(viewport=viewport, **options)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    page.wait_for_selector("body[data-rendered='1']", timeout=15000)
    return page, errors


@pytest.mark.browser
def test_page_in_chromium_shows_stages_chart_and_escapes_names(swarm):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed")
    from playwright.sync_api import sync_playwright

    tracker, _ = swarm
    wait_for(lambda: len(get_json(tracker.url + "/api/v1/swarm")["history"]) >= 3, 20, "a few history points")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-background-networking", "--disable-gpu"],
        )
        try:
            page, errors = rendered_page(browser, tracker.url, {"width": 1200, "height": 1400})
            rows = page.locator("#stage-table tbody tr")
            assert rows.count() == 3
            assert [rows.nth(i).locator("td.peers-online").inner_text() for i in range(3)] == ["1", "2", "1"]
            assert [rows.nth(i).locator("td.audited").inner_text() for i in range(3)] == ["no", "yes", "no"]
            assert page.locator("#verdict").inner_text() == "healthy"
            assert page.locator("#loss-chart svg path.series").count() == 1
            assert page.locator("#throughput-chart svg path.series").count() >= 1
            names = page.locator("#peer-table td.peer-name").all_inner_texts()
            assert XSS_SCRIPT in names and XSS_IMG in names
            assert page.evaluate("typeof window.__xss") == "undefined"
            assert page.locator("#peer-table img, #peer-table script").count() == 0
            assert page.locator("#peer-table td.lane, #stage-table td.lanes").count() == 0  # no lanes without CP
            assert errors == []
            page.screenshot(path=str(ARTIFACTS / "tracker-page.png"), full_page=True)

            phone, _ = rendered_page(
                browser, tracker.url, {"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True
            )
            # readable on a phone: the page itself does not scroll sideways (wide tables scroll in their box)
            assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
            phone.screenshot(path=str(ARTIFACTS / "tracker-page-phone.png"), full_page=True)
            assert phone.evaluate("typeof window.__xss") == "undefined"
        finally:
            browser.close()


def test_history_and_bootstrap_address_survive_a_restart(swarm):
    tracker, _ = swarm
    before = get_json(tracker.url + "/api/v1/swarm?history=2000")["history"]
    bootstrap = get_json(tracker.url + "/api/v1/bootstrap")["initial_peers"]
    assert len(before) >= 2
    tracker.stop()
    tracker.start()
    after = get_json(tracker.url + "/api/v1/swarm?history=2000")["history"]
    assert after[0]["time"] == before[0]["time"] and len(after) >= len(before)
    assert get_json(tracker.url + "/api/v1/bootstrap")["initial_peers"] == bootstrap
    # the peers still know the tracker's (unchanged) address and find it again
    wait_for(lambda: stage_counts(tracker.url) == [1, 2, 1], 30, "peers back after the restart")


def test_swarm_goes_unhealthy_when_a_stage_loses_its_only_peer(swarm):
    tracker, peers = swarm
    wait_for(lambda: get_json(tracker.url + "/api/v1/swarm")["healthy"], 20, "a healthy swarm first")
    peers["last"].announcing.clear()  # the peer dies: no more announcements, its 3 s record expires

    def unhealthy():
        body = get_json(tracker.url + "/api/v1/swarm")
        return (not body["healthy"]) and body

    body = wait_for(unhealthy, 20, "the verdict to turn unhealthy")
    assert [row["peers_total"] for row in body["stages"]] == [1, 2, 0]
    assert {"code": "empty_stage", "stage": 2} in [{"code": w["code"], "stage": w["stage"]} for w in body["warnings"]]
    families = {f.name: f for f in text_string_to_metric_families(get(tracker.url + "/metrics")[1].decode())}
    assert families["protocol_swarm_healthy"].samples[0].value == 0
    assert get_json(tracker.url + "/healthz")["swarm_healthy"] is False


# --- a context-parallel run: 2 stages x 2 lanes, lane 1 of stage 1 empty until a peer takes it ---


@pytest.fixture(scope="module")
def lane_swarm(tmp_path_factory):
    specs = [
        ("s0l0", 0, XSS_SCRIPT, 8.0, {"lane": 0}),
        ("s0l1", 0, "lane one", 8.0, {"lane": 1}),
        ("s1l0", 1, XSS_IMG, 8.0, {"lane": 0}),
    ]
    with tracked_swarm(tmp_path_factory.mktemp("tracker-lanes"), LANES_MANIFEST, specs) as found:
        yield found


def lanes_of(body: dict) -> list[list[int]]:
    return [[lane["peers_serving"] for lane in row["lanes"]] for row in body["stages"]]


def test_lanes_per_stage_and_an_empty_lane_in_the_json(lane_swarm):
    tracker, _, _ = lane_swarm

    def placed():
        body = get_json(tracker.url + "/api/v1/swarm")
        return body if lanes_of(body) == [[1, 1], [1, 0]] else None

    body = wait_for(placed, 30, "every peer in its lane")
    assert body["lanes"] == 2 and not body["healthy"]
    assert [row["empty_lanes"] for row in body["stages"]] == [[], [1]]
    assert {"code": "empty_lane", "stage": 1} in [{"code": w["code"], "stage": w["stage"]} for w in body["warnings"]]
    lanes = {p["public_name"]: p["lane"] for row in body["stages"] for p in row["peers"]}
    assert lanes == {XSS_SCRIPT: 0, "lane one": 1, XSS_IMG: 0}


@pytest.mark.browser
def test_page_in_chromium_shows_lanes_and_marks_the_empty_one(lane_swarm):
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian chromium is not installed")
    from playwright.sync_api import sync_playwright

    tracker, _, _ = lane_swarm
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page, errors = rendered_page(browser, tracker.url, {"width": 1200, "height": 1000})
            stage_rows = page.locator("#stage-table tbody tr")
            assert [stage_rows.nth(i).get_attribute("class") for i in range(2)] == ["ok", "empty"]
            assert stage_rows.nth(1).locator(".lane.empty").inner_text() == "1: empty"
            assert stage_rows.nth(0).locator(".lane.empty").count() == 0
            assert sorted(page.locator("#peer-table td.lane").all_inner_texts()) == ["0", "0", "1"]
            assert XSS_SCRIPT in page.locator("#peer-table td.peer-name").all_inner_texts()
            assert page.evaluate("typeof window.__xss") == "undefined" and errors == []
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "tracker-page-lanes.png"), full_page=True)
        finally:
            browser.close()


def test_a_peer_taking_the_empty_lane_makes_the_swarm_healthy(lane_swarm):
    tracker, peers, bootstrap = lane_swarm
    # a peer takes the empty lane: the swarm can carry trips again
    peers["s1l1"] = FakePeer(bootstrap, 1, "fills lane one", 8.0, manifest=LANES_MANIFEST, lane=1)
    peers["s1l1"].thread.start()
    body = wait_for(lambda: (b := get_json(tracker.url + "/api/v1/swarm"))["healthy"] and b, 30, "a healthy swarm")
    assert lanes_of(body) == [[1, 1], [1, 1]] and body["stages"][1]["empty_lanes"] == []
