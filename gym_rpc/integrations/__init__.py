"""Integrations for the Gym servers themselves (aiohttp and ASGI apps). Exports import on first use, so a server
that only wants the middleware does not load the control-plane client that registration needs.

* `_middleware`: `TraceContextPathMiddleware`, which strips the rollout and trace-context path prefixes
  (`_prefix_routes`: the aiohttp routes its `install(app)` registers).
* `_registration`: registering a server process with the head (`ServerRegistration` and app helpers);
  `_draining`: draining it on SIGTERM before it stops.
"""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.integrations._middleware import (
        ROLLOUT_ID_KEY,
        TOKEN_CAPTURE_KEY,
        TraceContextPathMiddleware,
    )
    from gym_rpc.integrations._registration import (
        RegistrationLifespan,
        ServerRegistration,
        register_aiohttp_app,
        with_registration,
    )

_EXPORTS = {
    "ROLLOUT_ID_KEY": "gym_rpc.integrations._middleware",
    "TOKEN_CAPTURE_KEY": "gym_rpc.integrations._middleware",
    "TraceContextPathMiddleware": "gym_rpc.integrations._middleware",
    "RegistrationLifespan": "gym_rpc.integrations._registration",
    "ServerRegistration": "gym_rpc.integrations._registration",
    "register_aiohttp_app": "gym_rpc.integrations._registration",
    "with_registration": "gym_rpc.integrations._registration",
}
__all__ = [
    "ROLLOUT_ID_KEY",
    "TOKEN_CAPTURE_KEY",
    "RegistrationLifespan",
    "ServerRegistration",
    "TraceContextPathMiddleware",
    "register_aiohttp_app",
    "with_registration",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
