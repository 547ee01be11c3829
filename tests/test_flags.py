"""The flag convention every command shares (`swarm/flags.py`)."""

from __future__ import annotations

import pytest

from swarm.flags import EnvDefaultsParser, add_log_level, env_name, refuse_start, split_list


def test_env_names_and_lists():
    assert env_name("PROTOCOL_PEER_", "--initial-peers") == "PROTOCOL_PEER_INITIAL_PEERS"
    # commas, whitespace or both: the docker health check and every command read a list the same way
    assert split_list("/ip4/1.2.3.4/tcp/1, /ip4/1.2.3.4/tcp/2\n/ip6/::1/tcp/3") == [
        "/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.4/tcp/2", "/ip6/::1/tcp/3"
    ]
    assert split_list(" ,, ") == []


def _parser(environ: dict[str, str]) -> EnvDefaultsParser:
    parser = EnvDefaultsParser(prog="protocol-test", env_prefix="PROTOCOL_TEST_", environ=environ)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--peers", nargs="*", default=[])
    parser.add_argument("--json", action="store_true")
    add_log_level(parser)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("run").add_argument("--steps", type=int, default=1)
    return parser


def test_environment_fills_defaults_and_the_command_line_wins():
    environ = {
        "PROTOCOL_TEST_MANIFEST": "m.json",
        "PROTOCOL_TEST_PORT": "9001",
        "PROTOCOL_TEST_PEERS": "a,b c",
        "PROTOCOL_TEST_JSON": "yes",
        "PROTOCOL_TEST_LOG_LEVEL": "debug",
        "PROTOCOL_TEST_STEPS": "7",
    }
    args = _parser(environ).parse_args(["run"])
    assert (args.manifest, args.port, args.peers, args.json, args.log_level) == ("m.json", 9001, ["a", "b", "c"],
                                                                                   True, "DEBUG")
    assert args.steps == 7  # a subcommand's flags follow the same rule
    args = _parser(environ).parse_args(["--port", "1", "run", "--steps", "2"])
    assert (args.port, args.steps) == (1, 2)
    assert _parser(environ).parse_args(["--peers"]).peers == []
    assert _parser({"PROTOCOL_TEST_MANIFEST": " "}).parse_args(["--manifest", "x"]).manifest == "x"  # blank: unset
    assert "[env PROTOCOL_TEST_PORT]" in _parser({}).format_help()


def test_bad_values_are_refused_like_flags(capsys):
    with pytest.raises(SystemExit):
        _parser({"PROTOCOL_TEST_MANIFEST": "m", "PROTOCOL_TEST_LOG_LEVEL": "chatty"}).parse_args([])
    assert "PROTOCOL_TEST_LOG_LEVEL='CHATTY'" in capsys.readouterr().err
    assert refuse_start("protocol-test", "no way in") == 2
    assert capsys.readouterr().err == "protocol-test: error: no way in\n"
