"""Control plane: what a user calls to get a usable config and server statuses, gym_rpc (gRPC, from the prober's
cache) against the way NeMo Gym does it (HTTP + JSON with `requests`), both served by another process.

Like with like:
* config fetch = the call that yields a usable config object: `ServerClient.load_from_global_config(head)` against
  `OmegaConf.create(json.loads(requests.get(head_url + "/global_config_dict_yaml").text))`.
* status of one server = `GetServerStatus(name, max_age=0)` (the head probes it now) against one `requests.get`
  of the server (NeMo Gym's client probes it itself); plus the cached variant (`max_age`), which is what
  `ServerClient.poll_for_status` gets within the head's freshness window.
* status of N servers = one `ListServerStatuses` against N sequential `requests.get`, also with servers that
  accept connections and never answer (NeMo Gym's client waits out each one's timeout).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import requests
import yaml
from omegaconf import DictConfig, OmegaConf

from bench.servers import wait_until
from bench.stats import Row, Samples, interleaved_latencies, ratio_row
from gym_rpc.client.control._channel import close_sync_channels
from gym_rpc.client.control._clients import SyncControlClient
from gym_rpc.client.server_client import ServerClient
from gym_rpc.config import BaseServerConfig

AREA = "control plane"


@dataclass(frozen=True)
class ControlPlan:
    servers: int = 200
    silent: int = 2
    probe_timeout: float = 2.0  # NeMo Gym-style sweep: seconds per silent server (DESIGN's 4.14 s for two)
    config_pairs: int = 30
    cold_pairs: int = 20
    first_read_pairs: int = 10
    rpc_pairs: int = 30
    list_pairs: int = 200
    status_pairs: int = 300
    sweep_pairs: int = 10
    silent_sweep_pairs: int = 3


QUICK_CONTROL = ControlPlan(
    servers=20,
    probe_timeout=0.1,
    config_pairs=4,
    cold_pairs=3,
    first_read_pairs=2,
    rpc_pairs=4,
    list_pairs=10,
    status_pairs=10,
    sweep_pairs=2,
    silent_sweep_pairs=1,
)


def nemo_gym_config_fetch(url: str) -> DictConfig:
    """What NeMo Gym's client does to get its config: a JSON string holding YAML, parsed by OmegaConf."""
    config = OmegaConf.create(json.loads(requests.get(url, timeout=30).text))  # NeMo Gym: no timeout; a bound here
    assert isinstance(config, DictConfig)
    return config


def nemo_gym_sweep(urls: list[str], timeout: float) -> int:
    """NeMo Gym's way to learn N statuses: one blocking GET per server, in turn. Returns how many answered."""
    answered = 0
    for url in urls:
        try:
            requests.get(url, timeout=timeout)
            answered += 1
        except requests.RequestException:
            pass
    return answered


def _row(measure: str, ours: Samples, baseline: Samples, baseline_name: str, goal: float | None) -> Row:
    ratio = baseline.p50_ms / ours.p50_ms
    return ratio_row(AREA, measure, ours.describe(), f"{baseline_name}: {baseline.describe()}", ratio, goal)


def _compare(
    label: str, ours: Callable[[], object], baseline: Callable[[], object], pairs: int
) -> tuple[Samples, Samples]:
    print(f"  control plane: {label} ({pairs} interleaved pairs)", file=sys.stderr)
    return interleaved_latencies(ours, baseline, pairs)


def _wait_for_first_probes(address: str, timeout: float) -> None:
    """Measure ListServerStatuses only once the prober has a result for every server."""
    client = SyncControlClient(address)
    wait_until(lambda: all(r.status is not None for r in client.list_server_statuses().reports), timeout, 0.1)


def run(info: dict[str, object], plan: ControlPlan) -> list[Row]:
    head_a = BaseServerConfig(host="127.0.0.1", port=int(str(info["head_a"])))
    address_a, address_b = f"127.0.0.1:{info['head_a']}", f"127.0.0.1:{info['head_b']}"
    yaml_url = f"http://127.0.0.1:{info['http_head']}/global_config_dict_yaml"
    urls_a = [str(u) for u in info["urls_a"]]  # type: ignore[attr-defined]
    urls_b = [str(u) for u in info["urls_b"]]  # type: ignore[attr-defined]
    names = [str(n) for n in info["names_a"]]  # type: ignore[attr-defined]
    n = plan.servers
    rows: list[Row] = []

    def load() -> ServerClient:
        return ServerClient.load_from_global_config(head_a)

    def load_cold() -> ServerClient:
        close_sync_channels()  # a fresh process: new channel, TCP and HTTP/2 setup, as requests.get always pays
        return load()

    def fetch_baseline() -> DictConfig:
        return nemo_gym_config_fetch(yaml_url)

    assert OmegaConf.to_container(load().global_config_dict) == OmegaConf.to_container(fetch_baseline())

    ours, base = _compare("config fetch", load, fetch_baseline, plan.config_pairs)
    rows.append(
        _row(f"config fetch → usable client/config, {n} entries", ours, base, "requests + OmegaConf", 30.0)
    )
    ours, base = _compare("config fetch, cold channel", load_cold, fetch_baseline, plan.cold_pairs)
    rows.append(
        _row(f"config fetch, new channel each time, {n} entries", ours, base, "requests + OmegaConf", 10.0)
    )
    ours, base = _compare(
        "config fetch + first read of global_config_dict",
        lambda: load().global_config_dict,
        fetch_baseline,
        plan.first_read_pairs,
    )
    rows.append(
        _row(
            f"config fetch + first read of global_config_dict (lazy DictConfig built), {n} entries",
            ours,
            base,
            "requests + OmegaConf",
            None,
        )
    )
    control_a = SyncControlClient(address_a)
    ours, base = _compare(
        "GetGlobalConfig RPC",
        control_a.get_global_config,
        lambda: yaml.safe_load(json.loads(requests.get(yaml_url).text)),
        plan.rpc_pairs,
    )
    rows.append(
        _row(
            f"GetGlobalConfig → typed GlobalConfig (no DictConfig), {n} entries",
            ours,
            base,
            "requests + YAML parse to plain dicts",
            None,
        )
    )

    name, url = names[1], urls_a[1]
    ours, base = _compare(
        "GetServerStatus, fresh probe",
        lambda: control_a.get_server_status(name, max_age_seconds=0),
        lambda: requests.get(url, timeout=5),
        plan.status_pairs,
    )
    rows.append(_row("status of one server, probed now via the head", ours, base, "requests.get", None))
    ours, base = _compare(
        "GetServerStatus max_age",
        lambda: control_a.get_server_status(name, max_age_seconds=5.0),
        lambda: requests.get(url, timeout=5),
        plan.status_pairs,
    )
    rows.append(_row("status of one server, cached (max_age 5 s)", ours, base, "requests.get", None))

    _wait_for_first_probes(address_a, 30.0)
    _wait_for_first_probes(address_b, 30.0)
    control_b = SyncControlClient(address_b)
    ours, base = _compare(
        f"ListServerStatuses of {n}",
        control_a.list_server_statuses,
        lambda: nemo_gym_sweep(urls_a, plan.probe_timeout),
        plan.sweep_pairs,
    )
    rows.append(_row(f"status of {n} servers, all answering", ours, base, f"{n} x requests.get", 50.0))
    ours, base = _compare(
        f"ListServerStatuses of {n}, {plan.silent} silent",
        control_b.list_server_statuses,
        lambda: nemo_gym_sweep(urls_b, plan.probe_timeout),
        plan.silent_sweep_pairs,
    )
    rows.append(
        _row(
            f"status of {n} servers, {plan.silent} silent (baseline timeout {plan.probe_timeout:g} s each)",
            ours,
            base,
            f"{n} x requests.get",
            50.0,
        )
    )
    with_silent, without = _compare(
        "ListServerStatuses, silent vs none",
        control_b.list_server_statuses,
        control_a.list_server_statuses,
        plan.list_pairs,
    )
    rows.append(
        _row(
            f"ListServerStatuses with {plan.silent} silent servers vs none (≈ 1x: silent ones cost nothing)",
            with_silent,
            without,
            "none silent",
            None,
        )
    )
    close_sync_channels()
    return rows
