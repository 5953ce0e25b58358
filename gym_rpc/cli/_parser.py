"""The `gym-rpc` parser: every command, its flags and their checks, and the credentials the head flags name.

The flags' helpers (a default from a variable, one-line usage errors) are in `_flags`; what each command does
with the flags is in `_serving` (head, bridge, relay, demo) and `_asking` (config, reload, status, wait).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from gym_rpc import __version__
from gym_rpc._environment import (
    CONFIG_ENV_VAR,
    CONNECT_PORT_ENV_VAR,
    HTTP_PORT_ENV_VAR,
    LOG_FORMAT_ENV_VAR,
    LOG_LEVEL_ENV_VAR,
    METRICS_PORT_ENV_VAR,
    OUTPUT_ENV_VAR,
    PROBE_INTERVAL_ENV_VAR,
    PROBE_TIMEOUT_ENV_VAR,
    TIMEOUT_ENV_VAR,
    WAIT_TIMEOUT_ENV_VAR,
)
from gym_rpc._logging import LOG_FORMATS, LOG_LEVELS
from gym_rpc.cli._exit_codes import UsageError
from gym_rpc.cli._flags import (
    HelpFormatter,
    OneLineErrorParser,
    add_subcommand,
    choice_of,
    env_flag,
    head_address,
    non_negative_float,
    port_number,
    positive_float,
    probe_interval,
    readable_file,
)
from gym_rpc.client import DEFAULT_TIMEOUT_SECONDS, ClientSecurity, client_security
from gym_rpc.errors import ConfigError
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR, WATCH_RELAY_ENV_VAR

# What `gym-rpc --help` says first: the commands' job and their exit codes (`_exit_codes`).
DESCRIPTION = """\
The `gym-rpc` command: run a head, ask one for its config and its servers' status, wait until servers are up.

Exit codes (what an orchestrator can act on; docs/cli.md):
0 success (`status`/`wait`: every server asked about is up); 1 a server is down (`status`, `wait` on timeout) or
the command failed; 2 bad usage (a flag, an environment variable, an unknown server name, a missing extra); 3 the
head could not be reached within the deadline; 4 the head refused our credentials (token missing or wrong, TLS
failed); 130 interrupted (Ctrl-C); 141 the reader of our output went away (a closed pipe, as SIGPIPE would end us).
"""

DEFAULT_HEAD = "127.0.0.1:11000"
DEFAULT_RELAY_LISTEN = (
    "127.0.0.1:11090"  # gym_rpc.server.watch_relay.DEFAULT_LISTEN (the server loads when it runs)
)
DEFAULT_WAIT_TIMEOUT_SECONDS = 300.0
OUTPUT_FORMATS = ("table", "json", "jsonl", "yaml")
STATUS_FORMATS = (*OUTPUT_FORMATS, "wide")  # wide: the table with labels and calls in flight, a line per instance
CONFIG_FORMATS = ("yaml", "json", "jsonl")


def _choice_flag(
    parser: argparse.ArgumentParser, *names: str, env: str, default: str, choices: Sequence[str], help: str
) -> None:
    """A flag taking one of `choices` (shown as {a,b,c}), its default from `$env` when set."""
    metavar = "{" + ",".join(choices) + "}"
    env_flag(parser, *names, env=env, default=default, parse=choice_of(choices), metavar=metavar, help=help)


def _add_log_flags(parser: argparse.ArgumentParser, default_level: str) -> None:
    _choice_flag(
        parser,
        "--log-level",
        env=LOG_LEVEL_ENV_VAR,
        default=default_level,
        choices=LOG_LEVELS,
        help="the least severe log records printed (to stderr)",
    )
    _choice_flag(
        parser,
        "--log-format",
        env=LOG_FORMAT_ENV_VAR,
        default="text",
        choices=LOG_FORMATS,
        help="text: `TIME LEVEL LOGGER: message`; json: one object per line, with trace and span ids",
    )


def _add_head_flags(
    parser: argparse.ArgumentParser, *, call_timeout: bool = True, log_level: str = "warning"
) -> None:
    env_flag(
        parser,
        "--head",
        env=HEAD_ADDRESS_ENV_VAR,
        default=DEFAULT_HEAD,
        parse=head_address,
        metavar="HOST:PORT",
        help="head server address",
    )
    parser.add_argument(
        "--token-file",
        type=readable_file,
        metavar="FILE",
        help="a file holding the head's bearer token (none: $GYM_RPC_TOKEN)",
    )
    parser.add_argument(
        "--cacert",
        type=readable_file,
        metavar="FILE",
        help="TLS: the CA that signed the head (none: $GYM_RPC_TLS_CA)",
    )
    parser.add_argument(
        "--cert", type=readable_file, metavar="FILE", help="mutual TLS: our certificate (none: $GYM_RPC_TLS_CERT)"
    )
    parser.add_argument(
        "--key", type=readable_file, metavar="FILE", help="mutual TLS: our private key (none: $GYM_RPC_TLS_KEY)"
    )
    if call_timeout:
        env_flag(
            parser,
            "--timeout",
            env=TIMEOUT_ENV_VAR,
            default=DEFAULT_TIMEOUT_SECONDS,
            parse=positive_float,
            metavar="S",
            help="deadline of each call to the head, in seconds",
        )
    _add_log_flags(parser, log_level)


def _add_output_flag(parser: argparse.ArgumentParser, choices: Sequence[str], default: str) -> None:
    _choice_flag(
        parser, "-o", "--output", env=OUTPUT_ENV_VAR, default=default, choices=choices, help="output format"
    )
    parser.add_argument("--json", dest="output", action="store_const", const="json", help="same as -o json")


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """What `head` and `bridge` both take: they are one server with two config sources."""
    env_flag(
        parser,
        "--probe-interval",
        env=PROBE_INTERVAL_ENV_VAR,
        default=2.0,
        parse=probe_interval,
        metavar="S",
        help="seconds between status probe rounds (at least 0.05)",
    )
    env_flag(
        parser,
        "--probe-timeout",
        env=PROBE_TIMEOUT_ENV_VAR,
        default=1.0,
        parse=positive_float,
        metavar="S",
        help="seconds a background probe may take",
    )
    parser.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    env_flag(
        parser,
        "--http-port",
        env=HTTP_PORT_ENV_VAR,
        default=None,
        parse=port_number,
        help="also serve NeMo Gym's HTTP head on this port, 0 for a free one (none: head_server.http_port)",
    )
    env_flag(
        parser,
        "--metrics-port",
        env=METRICS_PORT_ENV_VAR,
        default=None,
        parse=port_number,
        help="serve GET /metrics (Prometheus text) alone on this port, 0 for a free one (it is on the HTTP head's "
        "port too)",
    )
    parser.add_argument(
        "--ui-port",
        type=port_number,
        metavar="PORT",
        help="serve the status page (/ui/) alone on this port, 0 for a free one, without NeMo Gym's HTTP "
        "endpoints (it is on the HTTP head's port too)",
    )
    env_flag(
        parser,
        "--connect-port",
        env=CONNECT_PORT_ENV_VAR,
        default=None,
        parse=port_number,
        help="also serve the control plane over the Connect protocol (HTTP/1.1, JSON or binary) on this port, "
        "0 for a free one (none: head_server.connect_port)",
    )
    parser.add_argument(
        "--max-watches",
        type=_positive_int,
        metavar="N",
        help="status watches served at once; more get RESOURCE_EXHAUSTED (none: 16384)",
    )
    parser.add_argument(
        "--max-watches-per-address",
        type=_positive_int,
        metavar="N",
        help="status watches one client IP address may hold at once (every loopback address counts as one; health "
        "watches have a pool of the same size); more get RESOURCE_EXHAUSTED (none: 1024)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=_positive_int,
        metavar="N",
        help="gRPC connections one client IP address may hold at once on a head bound beyond loopback (every "
        "loopback address counts as one; at most a quarter of the total); more are closed at once (none: 1024)",
    )
    parser.add_argument(
        "--instance-series",
        type=_non_negative_int,
        metavar="N",
        help="export up to N instances one by one in the gym_instance_* metrics (their ids are addresses), the "
        "rest counted in gym_head_instance_series_dropped; at most 10000 (none: 0, no per-instance series)",
    )
    parser.add_argument(
        "--connection-idle",
        type=positive_float,
        metavar="S",
        help="seconds a gRPC connection may go without a call before the head closes it (none: 30)",
    )
    parser.add_argument(
        "--watch-stall",
        type=positive_float,
        metavar="S",
        help="seconds a status or health watch may wait for its reader to take a message before it is dropped "
        "(none: 10)",
    )
    parser.add_argument(
        "--open-registrations",
        action="store_true",
        help="accept RegisterServerInstance without a token on a head bound beyond loopback (by default such a "
        "head refuses registrations: anyone reaching the port could add or drain the instances clients call)",
    )
    _add_log_flags(parser, "info")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at least at info level")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="gym-rpc", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"gym-rpc {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return add_subcommand(parser, commands, name, help=help, description=help, formatter_class=HelpFormatter)

    head = command("head", "run a head server (the gRPC control plane)")
    env_flag(
        head,
        "--config",
        env=CONFIG_ENV_VAR,
        default=None,
        parse=Path,
        help="global config YAML (none: the embedded example config)",
    )
    head.add_argument("--host", help="bind host (none: head_server.host of the config)")
    head.add_argument("--port", type=port_number, help="bind port, 0 for a free one (none: head_server.port)")
    _add_serving_flags(head)
    head.add_argument(
        "--status-max-age",
        type=non_negative_float,
        metavar="S",
        help="seconds a cached status answers a status call stating no max_age (none: half the probe interval)",
    )

    bridge = command("bridge", "serve the gRPC control plane in front of a NeMo Gym HTTP head")
    bridge.add_argument("--upstream", required=True, metavar="URL", help="the NeMo Gym head, http://HOST:PORT")
    bridge.add_argument(
        "--listen", metavar="HOST:PORT", default=DEFAULT_HEAD, help="gRPC address, port 0 for a free one"
    )
    bridge.add_argument(
        "--config",
        type=Path,
        help="a config YAML whose head_server block says how the bridge serves, as for the head: auth_token, tls, "
        "health_port, http_port (it listens on --listen; what it serves is the upstream's config)",
    )
    bridge.add_argument(
        "--refresh-interval", type=positive_float, default=1.0, help="seconds between fetches from the upstream"
    )
    bridge.add_argument(
        "--fetch-timeout", type=positive_float, default=2.0, help="seconds one upstream request may take"
    )
    _add_serving_flags(bridge)

    relay = command(
        "relay", "follow the head's status watch once for this node and serve it to the node's own processes"
    )
    _add_head_flags(relay, call_timeout=False, log_level="info")
    env_flag(
        relay,
        "--listen",
        env=WATCH_RELAY_ENV_VAR,
        default=DEFAULT_RELAY_LISTEN,
        parse=str,
        metavar="unix:PATH|HOST:PORT",
        help="where the node's processes reach the relay: a unix socket or a loopback port, 0 for a free one "
        "(workers take the same value in GYM_RPC_WATCH_RELAY)",
    )
    relay.add_argument(
        "--allow-remote",
        action="store_true",
        help="listen on an address beyond loopback (the relay serves the head's view to whoever reaches it)",
    )
    relay.add_argument(
        "--max-watches", type=_positive_int, metavar="N", help="local watches served at once (none: 16384)"
    )
    relay.add_argument(
        "--watch-stall",
        type=positive_float,
        metavar="S",
        help="seconds a local watch may wait for its reader to take a message before it is dropped (none: 10)",
    )
    relay.add_argument("-v", "--verbose", action="store_true", help="log at least at info level")

    status = command("status", "show every server's status (or the named ones'); exit 1 when one is not up")
    status.add_argument("servers", nargs="*", metavar="NAME", help="only these servers (none: every server)")
    _add_head_flags(status)
    _add_output_flag(status, STATUS_FORMATS, "table")
    status.add_argument("--watch", action="store_true", help="redraw on every change until Ctrl-C")
    status.add_argument(
        "--max-wait",
        type=non_negative_float,
        metavar="S",
        help="with --watch: give up once the head has been unreachable this long (none: retry until Ctrl-C)",
    )
    status.add_argument(
        "--allow-down",
        action="append",
        default=[],
        metavar="NAME",
        help="a server that may be down without failing the command (repeat for more)",
    )

    wait = command("wait", "wait until the named servers (default: all) are up; exit 1 naming those still down")
    wait.add_argument("servers", nargs="*", metavar="SERVER", help="server names (none: every server)")
    env_flag(
        wait,
        "--timeout",
        env=WAIT_TIMEOUT_ENV_VAR,
        default=DEFAULT_WAIT_TIMEOUT_SECONDS,
        parse=positive_float,
        metavar="S",
        help="give up after this many seconds",
    )
    wait.add_argument(
        "--instances",
        type=_positive_int,
        metavar="N",
        help="wait until each server has at least N instances up (answering, not draining; with --label: "
        "carrying the label)",
    )
    wait.add_argument(
        "--label",
        action="append",
        default=[],
        type=_label_selector,
        metavar="KEY=VALUE",
        help="count only instances with this label (repeat: all of them); without --instances, one is enough",
    )
    _add_head_flags(wait, call_timeout=False)
    _add_output_flag(wait, OUTPUT_FORMATS, "table")

    config = command("config", "print the global config (secrets redacted), or check a config file")
    _add_head_flags(config)
    _add_output_flag(config, CONFIG_FORMATS, "yaml")
    config.add_argument("--yaml", dest="output", action="store_const", const="yaml", help="same as -o yaml")
    config.add_argument(
        "--include-secrets",
        action="store_true",
        help="ask for the secrets too (needs the head's token: --token-file or $GYM_RPC_TOKEN)",
    )
    config.add_argument(
        "--check",
        type=Path,
        metavar="FILE",
        help="validate FILE as the head would load it, without serving it or asking a head; exit 1 when invalid",
    )

    reload = command("reload", "make the head re-read its config file (the ReloadGlobalConfig RPC, as SIGHUP)")
    _add_head_flags(reload)

    demo = command("demo", "run a head, demo servers and rollouts end to end on loopback")
    demo.add_argument("--rollouts", type=_positive_int, default=300, help="how many rollouts to run")
    demo.add_argument("--concurrency", type=_positive_int, default=32, help="rollouts in flight at once")
    demo.add_argument(
        "--serve", action="store_true", help="then keep the head and the demo servers up until Ctrl-C"
    )

    completion = command("completion", "print a shell completion script (eval it in your shell's rc file)")
    completion.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell")
    return parser


def _label_selector(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, not {text!r}")
    return key.strip(), value.strip()


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def security_from_flags(args: argparse.Namespace) -> ClientSecurity:
    """The token and TLS the flags name, each falling back to its environment variable."""
    files = (("ca_file", args.cacert), ("client_cert_file", args.cert), ("client_key_file", args.key))
    tls = {key: str(path) for key, path in files if path is not None}
    token = None
    if args.token_file is not None:
        token = args.token_file.read_text(encoding="utf-8").strip()
        if not token:
            raise UsageError(f"--token-file {args.token_file}: the file is empty")
    try:
        return client_security({"tls": tls} if tls else {}, token=token)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
