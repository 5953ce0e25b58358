"""Registered hosts: a dotted number that is no IP address is no hostname either, and an IPv6 zone id is written
`%25` in the URL the head advertises (issue 14, item 17). Registrations go to a real head over gRPC."""

from __future__ import annotations

import pytest
import yarl

from gym_rpc.client.control._clients import ControlClient
from gym_rpc.config import base_url
from gym_rpc.errors import ControlPlaneError
from gym_rpc.server.registry._registry import is_valid_host
from tests.support.documents import document, server_entry


@pytest.mark.parametrize("host", ["999.1.1.1", "1.2.3", "256.0.0.1", "10.0.0.5.7", "node.123"])
def test_dotted_numbers_are_neither_addresses_nor_hostnames(host: str) -> None:
    assert not is_valid_host(host)


@pytest.mark.parametrize("host", ["node-3.cluster.local", "gpu7", "10.0.0.5", "fe80::1%eth0", "[fe80::1%eth0]"])
def test_names_and_addresses_still_pass(host: str) -> None:
    assert is_valid_host(host)


def test_a_zone_id_is_percent_encoded_in_urls() -> None:
    url = base_url("fe80::1%eth0", 8000)
    assert url == "http://[fe80::1%25eth0]:8000"
    assert yarl.URL(url).host == "fe80::1%eth0"  # and reads back as the address it names
    assert base_url("::1", 8000) == "http://[::1]:8000"


async def test_register_refuses_a_dotted_number_and_encodes_a_zone(head_factory) -> None:
    # Link-local addresses are advertised only when listed (SECURITY.md): this head lists fe80::/10.
    head_server = {"host": "127.0.0.1", "port": 0, "registration": {"allowed_networks": ["fe80::/10"]}}
    head = await head_factory(document({"policy": server_entry(8000, host="0.0.0.0")}, head_server=head_server))
    control = ControlClient(head.address)
    with pytest.raises(ControlPlaneError, match=r"INVALID_ARGUMENT.*advertise_host '999\.1\.1\.1'"):
        await control.register_server_instance("policy", listen_port=8001, advertise_host="999.1.1.1")
    url = await control.register_server_instance("policy", listen_port=8001, advertise_host="fe80::1%eth0")
    assert url == "http://[fe80::1%25eth0]:8001"
    (instance,) = [i for i in await control.list_server_instances() if i.name == "policy"]
    assert instance.advertised_url == "http://[fe80::1%25eth0]:8001"
