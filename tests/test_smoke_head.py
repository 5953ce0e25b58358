"""A first end-to-end check: a head serves its config and every status value is reached."""

from __future__ import annotations

import asyncio

from gym_rpc.control.client import ControlClient, SyncControlClient
from tests.conftest import closed_port, document, server_entry


async def test_statuses_and_config(head_factory, http_server, silent_server):
    live = await http_server()
    doc = document(
        {
            "live": server_entry(live),
            "closed": server_entry(closed_port(), "resources_servers"),
            "silent": server_entry(silent_server, "responses_api_agents"),
        }
    )
    head = await head_factory(doc)
    client = ControlClient(head.address)
    config = await client.get_global_config()
    assert list(config.servers) == ["live", "closed", "silent"]
    statuses = {
        name: (await client.get_server_status(name, timeout=1.0)).status for name in ("live", "closed", "silent")
    }
    assert statuses == {"live": "success", "closed": "connection_error", "silent": "timeout"}
    sync = SyncControlClient(head.address)
    report = await asyncio.to_thread(sync.get_server_status, "live")
    assert report.status == "success"
