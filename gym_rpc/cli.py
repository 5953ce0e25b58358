"""The `gym-rpc` command: run a head, and ask one for its config and its servers' status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import yaml

from gym_rpc._render import format_status_table, status_row
from gym_rpc.client._channel import DEFAULT_TIMEOUT_SECONDS, default_head_address
from gym_rpc.client._control import SyncControlClient
from gym_rpc.client._watch import SyncStatusWatch
from gym_rpc.config import (
    HEAD_SERVER_KEY,
    GlobalConfig,
    default_config_text,
    load_config_file,
    parse_config_text,
    url_host,
)
from gym_rpc.errors import ControlPlaneError, GymRpcError, HeadUnreachableError
from gym_rpc.wire import HEAD_ADDRESS_ENV_VAR, ServerInstance

if TYPE_CHECKING:
    from gym_rpc.server import HeadServer


def _non_negative_seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0 (NaN and negatives refused with a clear message)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _add_head_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--head",
        metavar="HOST:PORT",
        default=None,
        help=f"head server address (default: ${HEAD_ADDRESS_ENV_VAR}, else 127.0.0.1:11000)",
    )
    parser.add_argument(
        "--timeout", type=_seconds, default=DEFAULT_TIMEOUT_SECONDS, help="deadline of each call in seconds"
    )


def _add_serving_flags(parser: argparse.ArgumentParser) -> None:
    """What `head` and `bridge` both take: they are one server with two config sources."""
    parser.add_argument("--probe-interval", type=_seconds, default=2.0, help="seconds between status probe rounds")
    parser.add_argument("--probe-timeout", type=_seconds, default=1.0, help="seconds a background probe may take")
    parser.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    parser.add_argument(
        "--http-port",
        type=_port,
        help="also serve NeMo Gym's HTTP head on this port, 0 for a free one (default: head_server.http_port)",
    )
    parser.add_argument(
        "--max-watches",
        type=_positive_int,
        help="status watches served at once; more get RESOURCE_EXHAUSTED (default: 512)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def _serving_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {
        "probe_interval_seconds": args.probe_interval,
        "probe_timeout_seconds": args.probe_timeout,
        "reflection": not args.no_reflection,
    }
    return options if args.max_watches is None else {**options, "max_concurrent_watches": args.max_watches}


def _announce(kind: str, started: HeadServer, source: str) -> None:
    http = f"; NeMo Gym HTTP head on http://{url_host(started.host)}:{started.http_port}"
    health = f"; plaintext health service on {url_host(started.host)}:{started.health_port}"
    print(
        f"gym-rpc {kind} listening on {started.address} ({source}, {started.security.describe()})"
        f"{http if started.http_port is not None else ''}"
        f"{health if started.health_port is not None else ''}",
        flush=True,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gym-rpc", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    head = commands.add_parser("head", help="run a head server (the gRPC control plane)")
    head.add_argument("--config", type=Path, help="global config YAML (default: the embedded example config)")
    head.add_argument("--host", help="bind host (default: head_server.host of the config)")
    head.add_argument("--port", type=_port, help="bind port, 0 for a free one (default: head_server.port)")
    head.add_argument(
        "--status-max-age",
        type=_non_negative_seconds,
        help="seconds a cached status answers a status call stating no max_age (default: half the interval)",
    )
    _add_serving_flags(head)

    bridge = commands.add_parser("bridge", help="serve the gRPC control plane in front of a NeMo Gym HTTP head")
    bridge.add_argument("--upstream", required=True, metavar="URL", help="the NeMo Gym head, http://HOST:PORT")
    bridge.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=None,
        help="gRPC address, port 0 for a free one (default: head_server of --config, else 127.0.0.1:11000)",
    )
    bridge.add_argument(
        "--refresh-interval", type=_seconds, default=1.0, help="seconds between fetches from the upstream"
    )
    bridge.add_argument(
        "--fetch-timeout", type=_seconds, default=2.0, help="seconds one upstream request may take"
    )
    bridge.add_argument(
        "--config",
        type=Path,
        help="a config YAML whose head_server block sets where and how the bridge serves, as for the head: host, "
        "port, auth_token, tls, health_port, http_port (the upstream's config is what it serves)",
    )
    _add_serving_flags(bridge)

    status = commands.add_parser("status", help="show every server's status")
    _add_head_flags(status)
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--watch", action="store_true", help="redraw on every change until Ctrl-C")
    status.add_argument(
        "--max-wait",
        type=_non_negative_seconds,
        default=None,
        metavar="SECONDS",
        help="with --watch: give up once the head has been unreachable this long (default: retry until Ctrl-C)",
    )

    config = commands.add_parser("config", help="print the global config (secrets redacted)")
    _add_head_flags(config)
    form = config.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print JSON")
    form.add_argument("--yaml", action="store_true", help="print YAML (the default)")
    config.add_argument(
        "--include-secrets",
        action="store_true",
        help="ask for the secrets too (needs the head's token, from $GYM_RPC_TOKEN; else they stay redacted)",
    )

    demo = commands.add_parser("demo", help="run a head, demo servers and rollouts end to end on loopback")
    demo.add_argument("--rollouts", type=_positive_int, default=300, help="how many rollouts to run")
    demo.add_argument("--concurrency", type=_positive_int, default=32, help="rollouts in flight at once")
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as one line (argparse prints the whole usage text first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _port(text: str) -> int:
    """A port to bind, 0 for a free one: 70000 would silently bind 70000 - 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, not {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535 (0 picks a free port), not {value}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds: 0 spins a core, nan and inf never end."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, not {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        commands = {
            "head": cmd_head,
            "bridge": cmd_bridge,
            "status": cmd_status,
            "config": cmd_config,
            "demo": cmd_demo,
        }
        code = commands[args.command](args)
    except KeyboardInterrupt:
        code = 130
    except GymRpcError as exc:
        print(f"gym-rpc {args.command}: error: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


def cmd_head(args: argparse.Namespace) -> int:
    # The serving commands import the server layer when they run: `gym-rpc status` and friends start faster.
    from gym_rpc.server import HeadOptions, HeadServer, run_head

    _log_level(args)
    if args.config is not None:
        config, source = load_config_file(args.config), str(args.config)
    else:
        config, source = GlobalConfig.from_document(parse_config_text(default_config_text())), "embedded default"
    options = HeadOptions(
        host=args.host,
        port=args.port,
        status_max_age_seconds=args.status_max_age,
        http_port=args.http_port,
        **_serving_options(args),
    )
    what = f"config: {source}, version {config.version}, {len(config.servers)} servers"
    asyncio.run(
        run_head(HeadServer(config, options, config_path=args.config), lambda h: _announce("head", h, what))
    )
    return 0


def cmd_bridge(args: argparse.Namespace) -> int:
    from gym_rpc.server import BridgeHead, BridgeOptions, parse_listen_address, run_head  # lazy: see cmd_head

    _log_level(args)
    own = load_config_file(args.config).document[HEAD_SERVER_KEY] if args.config is not None else {}
    listen = args.listen or (f"{url_host(own['host'])}:{own['port']}" if own else "127.0.0.1:11000")
    host, port = parse_listen_address(listen)
    options = BridgeOptions(
        upstream_url=args.upstream,
        host=host,
        port=port,
        refresh_interval_seconds=args.refresh_interval,
        fetch_timeout_seconds=args.fetch_timeout,
        head_server={**own, **({"http_port": args.http_port} if args.http_port is not None else {})},
        **_serving_options(args),
    )
    bridge = BridgeHead(options)
    asyncio.run(run_head(bridge, lambda b: _announce("bridge", b, bridge.upstream_url)))
    return 0


def _log_level(args: argparse.Namespace) -> None:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from gym_rpc.demo import run_demo  # lazy, as cmd_head: the demo runs a head

    return asyncio.run(run_demo(args.rollouts, args.concurrency))


def _client(args: argparse.Namespace) -> SyncControlClient:
    return SyncControlClient(args.head or default_head_address(), timeout_seconds=args.timeout)


def cmd_config(args: argparse.Namespace) -> int:
    config = _client(args).get_global_config(include_secrets=args.include_secrets)
    if args.json:
        print(json.dumps(config.document, indent=2, ensure_ascii=False))
    else:
        print(yaml.safe_dump(config.document, sort_keys=False, allow_unicode=True), end="")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    instances = {i.name: i for i in client.list_server_instances()}  # an unreachable head fails here, at once
    if args.watch:
        return _watch(client, instances, as_json=args.json, max_wait=args.max_wait)
    snapshot = client.list_server_statuses()
    if args.json:
        print(json.dumps([status_row(r, instances.get(r.server_name)) for r in snapshot.reports], indent=2))
    else:
        print(format_status_table(snapshot.reports, instances))
    return 0


def _watch(
    client: SyncControlClient, instances: dict[str, ServerInstance], *, as_json: bool, max_wait: float | None
) -> int:
    """Redraw on every change; the watch itself reconnects and resumes when the head goes away."""

    def retrying(error: ControlPlaneError, pause: float) -> None:
        print(f"gym-rpc status: {error}; retrying in {pause:.1f}s", file=sys.stderr)

    watch = SyncStatusWatch(client, max_wait_seconds=max_wait, on_retry=retrying)
    for event in watch:
        if event.kind == "heartbeat":
            continue
        if event.kind == "snapshot" and event.compacted:  # a restarted head: its instances may have changed too
            with contextlib.suppress(HeadUnreachableError):  # gone again: the watch will say so and wait
                instances = {i.name: i for i in client.list_server_instances()}
        if as_json:
            rows = [status_row(r, instances.get(r.server_name)) for r in watch.reports.values()]
            print(json.dumps({"revision": watch.revision, "kind": event.kind, "servers": rows}), flush=True)
        else:
            clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
            print(
                f"{clear}revision {watch.revision}\n{format_status_table(list(watch.reports.values()), instances)}"
            )
            sys.stdout.flush()
    return 0
