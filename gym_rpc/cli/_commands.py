"""The `gym-rpc` command: run a head, ask one for its config and its servers' status, wait until servers are up.

Exit codes (what an orchestrator can act on; docs/cli.md):
0 success (`status`/`wait`: every server asked about is up); 1 a server is down (`status`, `wait` on timeout) or
the command failed; 2 bad usage (a flag, an environment variable, an unknown server name, a missing extra); 3 the
head could not be reached within the deadline; 4 the head refused our credentials (token missing or wrong, TLS
failed); 130 interrupted (Ctrl-C); 141 the reader of our output went away (a closed pipe, as SIGPIPE would end us).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from gym_rpc._logging import LOG_FORMATS, LOG_LEVELS, configure_logging
from gym_rpc.cli._flags import (
    HelpFormatter,
    OneLineErrorParser,
    add_subcommand,
    choice_of,
    env_errors,
    env_flag,
    head_address,
    non_negative_float,
    port_number,
    positive_float,
    probe_interval,
    readable_file,
)
from gym_rpc.client import (
    DEFAULT_TIMEOUT_SECONDS,
    ClientSecurity,
    SyncControlClient,
    SyncStatusWatch,
    client_security,
)
from gym_rpc.config import (
    HEAD_SERVER_KEY,
    GlobalConfig,
    config_from_bytes,
    default_config_text,
    load_config_file,
    parse_config_text,
    read_config_file,
    url_host,
)
from gym_rpc.errors import ConfigError, ControlPlaneError, GymRpcError, HeadUnreachableError, UnknownServerError
from gym_rpc.wire import (
    HEAD_ADDRESS_ENV_VAR,
    WATCH_RELAY_ENV_VAR,
    EngineLoad,
    InstanceReport,
    ServerInstance,
    StatusReport,
    StatusSnapshot,
    WatchEvent,
)

if TYPE_CHECKING:
    from gym_rpc.server import HeadServer

EXIT_OK = 0
EXIT_DOWN = 1  # also: the command failed
EXIT_USAGE = 2  # argparse's own code for bad usage
EXIT_HEAD_UNREACHABLE = 3
EXIT_CREDENTIALS_REFUSED = 4  # the head refused the token, or the TLS handshake failed
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell shows for a command whose reader went away

DEFAULT_HEAD = "127.0.0.1:11000"
DEFAULT_RELAY_LISTEN = (
    "127.0.0.1:11090"  # gym_rpc.server.watch_relay.DEFAULT_LISTEN (the server loads when it runs)
)
DEFAULT_WAIT_TIMEOUT_SECONDS = 300.0
WARM_UP_POLL_SECONDS = 0.1  # `status` asks a warming head again this often
OUTPUT_FORMATS = ("table", "json", "jsonl", "yaml")
STATUS_FORMATS = (*OUTPUT_FORMATS, "wide")  # wide: the table with labels and calls in flight, a line per instance
CONFIG_FORMATS = ("yaml", "json", "jsonl")

# How often `status --watch` (table) and `wait` hear from the head while nothing changes: the table's LAST CHECKED
# is redrawn from the head's latest probes, and `wait` notices its deadline.
WATCH_REFRESH_SECONDS = 1.0


class UsageError(GymRpcError):
    """A command line that names something that does not exist (exit 2)."""


# --- the parser --------------------------------------------------------------------------------------------------


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
    parser = OneLineErrorParser(prog="gym-rpc", description=__doc__, formatter_class=HelpFormatter)
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


# What each command needs beyond the base install: the extra that brings it, and the modules to look for.
_HEAD_MODULES = (
    "uvicorn",
    "connectrpc",
    "grpc_reflection",
    "opentelemetry.sdk",
    "opentelemetry.exporter.prometheus",
    "opentelemetry.instrumentation.grpc",
)
COMMAND_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "head": ("head", _HEAD_MODULES),
    "bridge": ("head", _HEAD_MODULES),
    "relay": ("head", _HEAD_MODULES),
    "demo": ("head", _HEAD_MODULES),
    "completion": ("completion", ("shtab",)),
}


def missing_extra(command: str) -> str | None:
    """One line naming the `pip install` that brings what `command` needs, when something is not installed."""
    extra, modules = COMMAND_EXTRAS.get(command, ("", ()))
    missing = [name for name in modules if not _importable(name)]
    if not missing:
        return None
    return (
        f"gym-rpc {command}: needs the {extra!r} extra ({', '.join(missing)} not installed): "
        f"pip install 'gym-rpc[{extra}]'"
    )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for problem in env_errors(parser, args.command):
        parser.exit(EXIT_USAGE, f"gym-rpc {args.command}: error: {problem}\n")
    missing = missing_extra(args.command)
    if missing is not None:
        parser.exit(EXIT_USAGE, missing + "\n")
    _set_up_logging(args)
    try:
        commands = {
            "head": cmd_head,
            "bridge": cmd_bridge,
            "relay": cmd_relay,
            "status": cmd_status,
            "wait": cmd_wait,
            "config": cmd_config,
            "reload": cmd_reload,
            "demo": cmd_demo,
            "completion": cmd_completion,
        }
        code = commands[args.command](args)
        sys.stdout.flush()  # here, where a closed pipe can still be told apart from a failure
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        code = _reader_gone()
    except UsageError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except ControlPlaneError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = _exit_code_of(exc)
    except GymRpcError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = EXIT_DOWN
    sys.exit(code)


# What gRPC's own message (the details of the UNAVAILABLE it ends in, as for a head that is down) says when the TLS
# handshake failed: "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...CERTIFICATE_VERIFY_FAILED".
_TLS_FAILURE_MARKS = ("handshake failed", "ssl_error", "certificate_verify_failed")


def _exit_code_of(error: ControlPlaneError) -> int:
    """Refused credentials (a wrong or missing token, a TLS handshake that failed), an unreachable head, or else
    a failed command."""
    if error.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return EXIT_CREDENTIALS_REFUSED
    if isinstance(error, HeadUnreachableError):
        details = getattr(error.__cause__, "details", None)
        said = (details() if callable(details) else "") or ""
        if error.code.name == "UNAVAILABLE" and any(mark in said.lower() for mark in _TLS_FAILURE_MARKS):
            return EXIT_CREDENTIALS_REFUSED
        return EXIT_HEAD_UNREACHABLE
    return EXIT_DOWN


def _reader_gone() -> int:
    """Our reader closed the pipe (`gym-rpc status | head -1`): end quietly, as a command killed by SIGPIPE does,
    and point stdout at /dev/null so the interpreter's last flush cannot fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _set_up_logging(args: argparse.Namespace) -> None:
    level = getattr(args, "log_level", "warning")
    if getattr(args, "verbose", False) and LOG_LEVELS.index(level) > LOG_LEVELS.index("info"):
        level = "info"
    configure_logging(level, getattr(args, "log_format", "text"))


# --- servers: head, bridge, demo ---------------------------------------------------------------------------------


def cmd_head(args: argparse.Namespace) -> int:
    # The serving commands import the server layer when they run: `gym-rpc status` and friends start faster.
    from gym_rpc.server import FileSource, HeadOptions, HeadServer, run_head

    loaded = None
    if args.config is not None:
        loaded = read_config_file(args.config)  # kept: a reload of these same bytes costs a hash, not a parse
        config, source = config_from_bytes(loaded, args.config), str(args.config)
    else:
        config, source = GlobalConfig.from_document(parse_config_text(default_config_text())), "embedded default"
    options = HeadOptions(
        host=args.host, port=args.port, status_max_age_seconds=args.status_max_age, **_serving_options(args)
    )
    head = HeadServer(config, options, source=FileSource(args.config, loaded))

    def announce(started: HeadServer) -> None:
        _announce("head", started, f"config: {source}, version {config.version}, {len(config.servers)} servers")

    asyncio.run(run_head(head, announce))
    return EXIT_OK


def cmd_bridge(args: argparse.Namespace) -> int:
    from gym_rpc.server import BridgeHead, BridgeOptions, parse_listen_address, run_head  # lazy: see cmd_head

    own = load_config_file(args.config).document[HEAD_SERVER_KEY] if args.config is not None else {}
    host, port = parse_listen_address(args.listen)
    options = BridgeOptions(
        upstream_url=args.upstream,
        host=host,
        port=port,
        refresh_interval_seconds=args.refresh_interval,
        fetch_timeout_seconds=args.fetch_timeout,
        head_server=own,
        **_serving_options(args),
    )

    def announce(started: BridgeHead) -> None:
        _announce("bridge", started, started.upstream_url)

    asyncio.run(run_head(BridgeHead(options), announce))
    return EXIT_OK


def cmd_relay(args: argparse.Namespace) -> int:
    from gym_rpc.server.watch_relay import WatchRelay, run_relay  # lazy: see cmd_head

    security = _security(args)
    options: dict[str, Any] = {}
    if args.max_watches is not None:
        options["max_watches"] = args.max_watches
    if args.watch_stall is not None:
        options["watch_stall_seconds"] = args.watch_stall
    try:
        relay = WatchRelay(args.head, args.listen, security=security, allow_remote=args.allow_remote, **options)
    except GymRpcError as exc:  # an address it may not listen on
        raise UsageError(f"--listen: {exc}") from None

    def announce(started: WatchRelay) -> None:
        guard = "token required" if security.token else "no token"
        print(
            f"gym-rpc relay listening on {started.address} (following the head at {args.head}, {guard})",
            flush=True,
        )

    asyncio.run(run_relay(relay, announce))
    return EXIT_OK


def _announce(kind: str, started: HeadServer, source: str) -> None:
    """The one line a serving command prints once it serves: where, from what, how guarded, and its other ports."""
    host = url_host(started.host)
    extras = [
        f"; NeMo Gym HTTP head on http://{host}:{started.http_port}" if started.http_port is not None else "",
        f"; plaintext health service on {host}:{started.health_port}" if started.health_port is not None else "",
        f"; metrics on http://{host}:{started.metrics_port}/metrics" if started.metrics_port is not None else "",
        f"; status page on http://{host}:{started.ui_port}/ui/" if started.ui_port is not None else "",
        f"; Connect on {started.connect_url}" if started.connect_url is not None else "",
    ]
    guard = started.security.describe()
    if started.registrations_off is not None:
        guard += ", registrations off (--open-registrations or a token turns them on)"
    print(f"gym-rpc {kind} listening on {started.address} ({source}, {guard}){''.join(extras)}", flush=True)


def _serving_options(args: argparse.Namespace) -> dict[str, Any]:
    """HeadOptions' fields from the flags `_add_serving_flags` adds, for `head` and `bridge` alike; a flag not
    given (None) keeps HeadOptions' default (the ports' is None too)."""
    given = {
        "probe_interval_seconds": args.probe_interval,
        "probe_timeout_seconds": args.probe_timeout,
        "reflection": not args.no_reflection,
        "http_port": args.http_port,
        "metrics_port": args.metrics_port,
        "ui_port": args.ui_port,
        "connect_port": args.connect_port,
        "open_registrations": args.open_registrations,
        "max_concurrent_watches": args.max_watches,
        "max_watches_per_peer": args.max_watches_per_address,
        "max_connections_per_address": args.max_connections_per_address,
        "watch_stall_seconds": args.watch_stall,
        "connection_idle_seconds": args.connection_idle,
        "instance_series": args.instance_series,
    }
    return {option: value for option, value in given.items() if value is not None}


def cmd_demo(args: argparse.Namespace) -> int:
    from gym_rpc.cli.demo import run_demo

    return asyncio.run(run_demo(args.rollouts, args.concurrency, serve=args.serve))


def cmd_completion(args: argparse.Namespace) -> int:
    import shtab

    print(shtab.complete(build_parser(), shell=args.shell))
    return EXIT_OK


# --- clients: config, status, wait -------------------------------------------------------------------------------


def _security(args: argparse.Namespace) -> ClientSecurity:
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


def _client(args: argparse.Namespace, timeout: float | None = None) -> SyncControlClient:
    seconds: float = timeout if timeout is not None else args.timeout
    return SyncControlClient(args.head, timeout_seconds=seconds, security=_security(args))


def cmd_config(args: argparse.Namespace) -> int:
    from gym_rpc.cli._render import render_document

    if args.check is not None:
        return _check_config(args.check)
    client = _client(args)
    if args.include_secrets and client.security.token is None:
        raise UsageError(
            "--include-secrets needs the head's token (--token-file FILE or GYM_RPC_TOKEN): without it the head "
            "sends the secrets redacted"
        )
    config = client.get_global_config(include_secrets=args.include_secrets)
    print(render_document(config.document, args.output))
    return EXIT_OK


def _check_config(path: Path) -> int:
    """`config --check FILE`: the file loaded and validated exactly as `gym-rpc head --config FILE` would."""
    config = load_config_file(path)  # a malformed file raises ConfigError: one line, exit 1
    for name, reason in config.malformed_servers.items():
        print(f"gym-rpc config: warning: {path}: {name} is not served: {reason}", file=sys.stderr)
    print(f"{path}: valid, version {config.version}, {len(config.servers)} servers ({', '.join(config.servers)})")
    return EXIT_OK


def cmd_reload(args: argparse.Namespace) -> int:
    version, changed = _client(args).reload_global_config()
    print(f"config version {version} ({'changed' if changed else 'unchanged'})")
    return EXIT_OK


def _instances(client: SyncControlClient) -> list[ServerInstance]:
    return client.list_server_instances()


def _require_known(names: Sequence[str], reports: Sequence[StatusReport], flag: str) -> None:
    known = [r.server_name for r in reports]
    for name in names:
        if name not in known:
            raise UsageError(f"{flag}: {UnknownServerError(name, known)}")


def _not_up(reports: Sequence[StatusReport], exempt: Sequence[str] = ()) -> list[StatusReport]:
    return [r for r in reports if r.status != "success" and r.server_name not in exempt]


def _print_statuses(
    reports: Sequence[StatusReport],
    instances: Sequence[ServerInstance],
    output: str,
    exempt: Sequence[str],
    engine_loads: Sequence[EngineLoad] = (),
) -> None:
    from gym_rpc.cli._render import format_status_table, format_wide_table, render_rows, status_rows, summary_line

    if output == "wide":
        print(format_wide_table(reports, instances, color=sys.stdout.isatty()))
        print(summary_line(reports, exempt))
    elif output == "table":
        print(format_status_table(reports, instances, color=sys.stdout.isatty(), engine_loads=engine_loads))
        print(summary_line(reports, exempt))
    else:
        print(render_rows(status_rows(reports, instances, engine_loads=engine_loads), output))  # type: ignore[arg-type]
    sys.stdout.flush()


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.watch:
        return _watch_status(client, args)
    snapshot = client.list_server_statuses()
    reports = snapshot.reports
    _require_known(args.allow_down, reports, "--allow-down")
    _require_known(args.servers, reports, "status")
    if args.servers:
        reports = [r for r in reports if r.server_name in args.servers]
    snapshot, reports = _after_warm_up(client, snapshot, args.servers, time.monotonic() + args.timeout)
    instances = _instances(client)
    _print_statuses(reports, instances, args.output, args.allow_down, snapshot.engine_loads)
    return EXIT_DOWN if _not_up(reports, args.allow_down) else EXIT_OK


def _after_warm_up(
    client: SyncControlClient, snapshot: StatusSnapshot, names: Sequence[str], deadline: float
) -> tuple[StatusSnapshot, list[StatusReport]]:
    """The head's statuses (those of `names`, or all) once it has probed every server among them: a head that just
    started (or restarted) has not yet, and its servers are pending, not down. Asked again every
    WARM_UP_POLL_SECONDS until `deadline`."""

    def chosen(statuses: StatusSnapshot) -> list[StatusReport]:
        return [r for r in statuses.reports if not names or r.server_name in names]

    reports = chosen(snapshot)
    while any(report.status is None for report in reports) and time.monotonic() < deadline:
        time.sleep(WARM_UP_POLL_SECONDS)
        snapshot = client.list_server_statuses()
        reports = chosen(snapshot)
    return snapshot, reports


def watch_events(
    client: SyncControlClient,
    *,
    heartbeat_seconds: float | None = None,
    deadline: float | None = None,
    max_wait: float | None = None,
) -> Iterator[WatchEvent]:
    """The head's status events from the library's watch (gym_rpc.client.control._watch), which reconnects with
    capped, jittered backoff and resumes from the last revision. It gives up, raising the last
    HeadUnreachableError, once the head has been unreachable `max_wait` seconds or at `deadline`
    (time.monotonic()); else never."""

    def retrying(error: ControlPlaneError, pause: float) -> None:
        print(f"gym-rpc: {error}; retrying in {pause:.1f}s", file=sys.stderr)

    watch = SyncStatusWatch(
        client, heartbeat_seconds=heartbeat_seconds, max_wait_seconds=max_wait, until=deadline, on_retry=retrying
    )
    yield from watch


def _watch_status(client: SyncControlClient, args: argparse.Namespace) -> int:
    """Redraw on every change; the table also every WATCH_REFRESH_SECONDS, so LAST CHECKED stays true.

    Every drawing is taken from ListServerStatuses, not from the events alone: a change event carries only the
    servers that changed, and the head probes the others on without telling the watch (their last check moves
    on while their status stays).
    """
    from gym_rpc.cli._render import render_document, status_rows

    table = args.output in ("table", "wide")
    terminal = sys.stdout.isatty()
    _require_known(args.allow_down, client.list_server_statuses().reports, "--allow-down")  # fails fast too
    heartbeat = WATCH_REFRESH_SECONDS if table else None
    for event in watch_events(client, heartbeat_seconds=heartbeat, max_wait=args.max_wait):
        if event.kind == "heartbeat" and not (table and terminal):
            continue  # piped output gets a drawing per change, not per second
        snapshot, instances = client.list_server_statuses(), _instances(client)
        reports, loads = snapshot.reports, snapshot.engine_loads
        if table:
            if terminal:
                print("\x1b[H\x1b[2J", end="")
            print(f"revision {event.revision}")
            _print_statuses(reports, instances, args.output, args.allow_down, loads)
        else:
            servers = status_rows(reports, instances, engine_loads=loads)
            document = {"revision": event.revision, "kind": event.kind, "servers": servers}
            print(render_document(document, "jsonl" if args.output == "json" else args.output), flush=True)
            if args.output == "yaml":
                print("---", flush=True)
    return EXIT_OK  # the stream never ends by itself: Ctrl-C or giving up ends the command


def cmd_wait(args: argparse.Namespace) -> int:
    """Block on the watch until every named server (or all) is up, or the timeout passes."""
    from gym_rpc.cli._render import summary_line

    deadline = time.monotonic() + args.timeout
    client = _client(args, DEFAULT_TIMEOUT_SECONDS)
    progress = _WaitProgress(args.timeout, deadline)
    need = WaitNeed(args.instances, dict(args.label))
    reports: dict[str, StatusReport] = {}
    try:
        for event in watch_events(client, heartbeat_seconds=WATCH_REFRESH_SECONDS, deadline=deadline):
            if event.kind == "snapshot":
                reports = {}
                _require_known(args.servers, event.reports, "wait")
            reports.update((r.server_name, r) for r in event.reports)
            watched = [r for name, r in reports.items() if not args.servers or name in args.servers]
            if not need.waiting_for(watched):
                progress.done()
                _print_wait_result(watched, client, args.output)
                return EXIT_OK
            progress.show(need.waiting_for(watched))
            if time.monotonic() >= deadline:
                break
    except HeadUnreachableError:
        progress.done()
        if not reports:
            raise
    progress.done()
    watched = [r for name, r in reports.items() if not args.servers or name in args.servers]
    down = need.waiting_for(watched)
    missing = f"; waiting for {', '.join(down)}" if down and need.counts_instances else ""
    print(f"gym-rpc wait: timed out after {args.timeout:g}s; {summary_line(watched)}{missing}", file=sys.stderr)
    _print_wait_result(watched, client, args.output)
    return EXIT_DOWN if down else EXIT_OK


@dataclass(frozen=True)
class WaitNeed:
    """What `wait` waits for: every server up (the default), or at least `instances` instances of each up and not
    draining, counting only those carrying every label of `labels`."""

    instances: int | None = None
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def counts_instances(self) -> bool:
        return self.instances is not None or bool(self.labels)

    def ready_instances(self, report: StatusReport) -> int:
        members = report.instances or (InstanceReport(instance_id="", url=report.url, status=report.status),)
        return sum(
            1
            for i in members
            if i.status == "success"
            and not i.draining
            and all(i.labels.get(k) == v for k, v in self.labels.items())
        )

    def waiting_for(self, reports: Sequence[StatusReport]) -> list[str]:
        """Each server not there yet, with why: `name (status)`, or `name (1/4 instances up with k=v)`."""
        if not self.counts_instances:
            return [f"{r.server_name} ({r.status or 'pending'})" for r in _not_up(reports)]
        need = self.instances or 1
        with_labels = (
            f" with {','.join(f'{k}={v}' for k, v in sorted(self.labels.items()))}" if self.labels else ""
        )
        return [
            f"{r.server_name} ({ready}/{need} instances up{with_labels})"
            for r in reports
            if (ready := self.ready_instances(r)) < need
        ]


def _print_wait_result(reports: Sequence[StatusReport], client: SyncControlClient, output: str) -> None:
    from gym_rpc.cli._render import render_rows, status_rows, summary_line

    if output == "table":
        print(summary_line(reports), flush=True)
        return
    try:
        instances = _instances(client)
    except GymRpcError:
        instances = []
    print(render_rows(status_rows(reports, instances), output), flush=True)  # type: ignore[arg-type]


class _WaitProgress:
    """What `wait` shows on stderr while it waits: one line redrawn in place on a terminal, a line per change
    otherwise."""

    def __init__(self, timeout: float, deadline: float) -> None:
        self._deadline = deadline
        self._last = ""
        self._live = sys.stderr.isatty()
        if self._live:
            self._draw("gym-rpc wait: waiting for the head")

    def _draw(self, line: str) -> None:
        sys.stderr.write(f"\r\x1b[2K{line}")  # back to the line's start, clear it, draw
        sys.stderr.flush()

    def show(self, waiting: Sequence[str]) -> None:
        names = ", ".join(waiting)
        if self._live:
            left = max(0.0, self._deadline - time.monotonic())
            self._draw(f"gym-rpc wait: waiting for {names} ({left:.0f}s left)")
        elif names != self._last:
            print(f"gym-rpc wait: waiting for {names}", file=sys.stderr, flush=True)
        self._last = names

    def done(self) -> None:
        if self._live:
            self._draw("")
            self._live = False
