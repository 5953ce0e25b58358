"""Who may remove a registration, and where a registration may send clients (issue 26, point 8), against a real
`gym-rpc head`: a deregistration naming no process or another process removes nothing, link-local and cloud
metadata addresses are refused unless listed, and `head_server.registration.allowed_networks` limits the rest."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.config import head_server_settings
from gym_rpc.errors import ConfigError, ControlPlaneError
from gym_rpc.server.security._address_policy import AddressPolicy
from tests.support.cli import run_cli, running_head
from tests.support.documents import document, server_entry
from tests.support.loopback import LOOPBACK, closed_port

METADATA_HOSTS = [
    "169.254.169.254",
    "169.254.0.1",
    "fd00:ec2::254",
    "[fd00:ec2::254]",
    "::ffff:169.254.169.254",
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:a9fe:a9fe::1",  # 6to4 of it
    "fe80::1%eth0",
    "metadata.google.internal",
    "Metadata.Google.Internal.",
    "100.100.100.200",
]


def write_config(tmp_path: Path, head_server: dict[str, Any] | None = None) -> Path:
    doc = document({"policy": server_entry(closed_port(), host="0.0.0.0")})
    doc["head_server"].update(head_server or {})
    path = tmp_path / "gym.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


async def advertised(client: ControlClient) -> tuple[int, str]:
    (row,) = [i for i in await client.list_server_instances(timeout=10) if i.name == "policy"]
    return row.pid, row.advertised_url


async def test_deregistration_never_removes_a_registration_it_does_not_own(tmp_path: Path) -> None:
    with running_head(write_config(tmp_path)) as head:
        client = ControlClient(head.address)
        port = closed_port()
        url = await client.register_server_instance("policy", listen_port=port, listen_host="0.0.0.0", pid=4242)
        with pytest.raises(ControlPlaneError) as caught:
            await client.deregister_server_instance("policy", pid=0)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "pid is required" in str(caught.value)
        for other in (1, 4241, head.process.pid):  # other processes (the head itself among them)
            assert await client.deregister_server_instance("policy", pid=other) is False
        assert await advertised(client) == (4242, url)  # still there, still where it said
        assert await client.deregister_server_instance("policy", pid=4242) is True
        assert await advertised(client) == (0, "")


@pytest.mark.parametrize("field", ["advertise_host", "listen_host"])
async def test_link_local_and_metadata_addresses_are_refused_unless_listed(tmp_path: Path, field: str) -> None:
    with running_head(write_config(tmp_path)) as head:
        client = ControlClient(head.address)

        async def register(host: str) -> str:
            listen, advertise = (host, "") if field == "listen_host" else ("", host)
            return await client.register_server_instance(
                "policy", listen_port=8001, pid=7, listen_host=listen, advertise_host=advertise
            )

        for host in METADATA_HOSTS:
            with pytest.raises(ControlPlaneError) as caught:
                await register(host)
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED, (host, str(caught.value))
            assert "allowed_networks" in str(caught.value)
        assert await advertised(client) == (0, "")  # nothing was taken
        assert await register("10.0.0.5") == "http://10.0.0.5:8001"


async def test_allowed_networks_limit_what_may_be_advertised(tmp_path: Path) -> None:
    allowed = ["10.0.0.0/8", "169.254.169.254/32", "*.cluster.local", "gpu7"]
    config = write_config(tmp_path, {"registration": {"allowed_networks": allowed}})
    with running_head(config) as head:
        client = ControlClient(head.address)
        for host in ["10.1.2.3", "::ffff:10.0.0.9", "169.254.169.254", "node-1.cluster.local", "GPU7"]:
            await client.register_server_instance("policy", listen_port=8001, pid=7, advertise_host=host)
        for host in ["192.168.1.1", "169.254.169.253", "cluster.local", "gpu8", "metadata.google.internal"]:
            with pytest.raises(ControlPlaneError, match=r"PERMISSION_DENIED.*not in head_server\.registration"):
                await client.register_server_instance("policy", listen_port=8001, pid=7, advertise_host=host)
        # A wildcard-bound server is advertised at the address it called from: loopback, not listed here.
        with pytest.raises(ControlPlaneError, match=f"PERMISSION_DENIED.*{LOOPBACK} is not in"):
            await client.register_server_instance("policy", listen_port=8001, pid=7, listen_host="0.0.0.0")


def test_a_malformed_allowed_network_stops_the_head_with_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path, {"registration": {"allowed_networks": ["10.0.0.0/33"]}})
    result = run_cli(["head", "--config", str(config), "--port", "0"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "head_server.registration.allowed_networks" in line and "10.0.0.0/33" in line


def test_the_policy_reads_embedded_ipv4_forms() -> None:
    policy = AddressPolicy()
    assert policy.refusal("10.0.0.1") is None and policy.refusal("gpu7") is None
    assert policy.refusal("::ffff:169.254.169.254") is not None
    assert AddressPolicy(["169.254.0.0/16"]).refusal("::ffff:169.254.169.254") is None


def test_unknown_registration_keys_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"head_server\.registration\.allowed_network"):
        head_server_settings({"host": LOOPBACK, "port": 0, "registration": {"allowed_network": ["10.0.0.0/8"]}})


async def test_an_unchanged_registration_is_logged_at_debug_a_change_at_info(tmp_path: Path) -> None:
    with running_head(write_config(tmp_path), "--log-level", "debug") as head:
        client = ControlClient(head.address)
        for port in (8001, 8001, 8001, 8001, 8002):  # three renewals, then a move
            await client.register_server_instance("policy", listen_port=port, advertise_host="10.0.0.5", pid=7)
        await asyncio.to_thread(head.wait_for_stderr, "registered pid 7 at http://10.0.0.5:8002", 20)
    lines = head.stderr_text.splitlines()
    info = [line for line in lines if " INFO gym_rpc.head: policy: registered pid 7" in line]
    debug = [
        line for line in lines if " DEBUG gym_rpc.head: policy: renewed pid 7 at http://10.0.0.5:8001" in line
    ]
    assert (len(info), len(debug)) == (2, 3), lines
