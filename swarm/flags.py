"""One convention for the flags of the three commands (`protocol-swarm`, `protocol-peer`, `protocol-tracker`).

- Every flag can also come from the environment as PROTOCOL_<COMMAND>_<FLAG>: the command's name
  without `protocol-`, and the flag, upper-cased with dashes as underscores (`--initial-peers` of
  `protocol-peer` is PROTOCOL_PEER_INITIAL_PEERS). A flag on the command line wins.
- A list in the environment is separated by commas or whitespace (or both): multiaddrs, URLs and
  paths hold neither. A switch is on for 1, true, yes or on.
- `--log-level` takes DEBUG, INFO, WARNING or ERROR, in any case.
- A reason not to start is one line on stderr, `<command>: error: <reason>`, and exit status 2, as
  argparse reports a bad flag.

It lives in `swarm` because it is the one package every command may import.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Mapping

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
USAGE_ERROR = 2  # the exit status of a refused start, the same as argparse's for a bad flag
_TRUE = ("1", "true", "yes", "on")


def env_name(prefix: str, flag: str) -> str:
    """`env_name("PROTOCOL_PEER_", "--initial-peers")` is "PROTOCOL_PEER_INITIAL_PEERS"."""
    return prefix + flag.lstrip("-").replace("-", "_").upper()


def split_list(raw: str) -> list[str]:
    """A list from the environment: items separated by commas or whitespace."""
    return [item for item in re.split(r"[\s,]+", raw) if item]


def env_default(raw: str, action: str | None, nargs) -> object:
    """What a flag's environment value means, before argparse applies the flag's `type`."""
    if action == "store_true":
        return raw.strip().lower() in _TRUE
    if nargs in ("*", "+"):
        return split_list(raw)
    return raw


class EnvDefaultsParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags take their defaults from PROTOCOL_<COMMAND>_<FLAG> when set (and not
    empty); the variable is named in each flag's help. Subcommands share their parent's prefix."""

    def __init__(self, *args, env_prefix: str, environ: Mapping[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.env_prefix = env_prefix
        self.environ = os.environ if environ is None else environ
        self._env_choices: list[tuple[str, str, tuple]] = []  # (dest, variable, choices) of env-given values

    def add_argument(self, *args, **kwargs):
        flag = next((a for a in args if a.startswith("--")), None)
        if flag and flag != "--help":
            name = env_name(self.env_prefix, flag)
            if kwargs.get("help") != argparse.SUPPRESS:
                kwargs["help"] = (kwargs.get("help") or "") + f" [env {name}]"
            raw = self.environ.get(name)
            if raw is not None and raw.strip():
                kwargs["default"] = env_default(raw, kwargs.get("action"), kwargs.get("nargs"))
                kwargs.pop("required", None)  # given by the environment
                action = super().add_argument(*args, **kwargs)
                if action.choices is not None:  # argparse checks choices on the command line only
                    self._env_choices.append((action.dest, name, tuple(action.choices)))
                return action
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        for dest, name, choices in self._env_choices:
            if getattr(namespace, dest, None) not in choices:
                self.error(f"{name}={getattr(namespace, dest)!r}: choose from {', '.join(map(str, choices))}")
        return namespace, extras

    def add_subparsers(self, **kwargs):
        prefix, environ = self.env_prefix, self.environ

        def subparser(**parser_kwargs) -> EnvDefaultsParser:
            return EnvDefaultsParser(env_prefix=prefix, environ=environ, **parser_kwargs)

        kwargs.setdefault("parser_class", subparser)
        return super().add_subparsers(**kwargs)


def add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="how much to log")


def refuse_start(prog: str, reason: object, status: int = USAGE_ERROR) -> int:
    """Report a reason not to start the one way every command does; the exit status to return."""
    print(f"{prog}: error: {reason}", file=sys.stderr)
    return status
