"""What the registry tells the prober, written out for tests that drive a StatusProber directly."""

from __future__ import annotations

import dataclasses

from gym_rpc.config import ServerEntry
from gym_rpc.server.fleet._server_instances import InstanceTarget, config_targets
from gym_rpc.wire import RegistrationState


def registered_as(
    entry: ServerEntry, state: RegistrationState | None, advertised_url: str = ""
) -> tuple[InstanceTarget, ...]:
    """The server's config instances with its config instance's registration `state` (at `advertised_url`)."""
    own, *replicas = config_targets(entry)
    return (dataclasses.replace(own.with_registration(state), advertised_url=advertised_url), *replicas)
