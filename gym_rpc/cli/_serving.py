"""The commands that serve: `head`, `bridge`, `relay` and `demo`.

Each imports the server layer (or the demo) only when it runs: the commands that only ask a head (`_asking`)
start without it.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, Any

from gym_rpc.cli._exit_codes import EXIT_OK, UsageError
from gym_rpc.cli._parser import security_from_flags
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
from gym_rpc.errors import GymRpcError

if TYPE_CHECKING:
    from gym_rpc.server import HeadServer


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

    security = security_from_flags(args)
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
