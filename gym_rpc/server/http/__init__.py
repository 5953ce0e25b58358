"""The head's HTTP side: NeMo Gym's HTTP head endpoints, the status page at /ui/ and its data, the service over
the Connect protocol, and a CPU budget for decoding Connect bodies.

Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.server.http._connect import ConnectServer
    from gym_rpc.server.http._nemo_gym_endpoints import HttpHead
    from gym_rpc.server.http._status_page import PageServer, StatusPage

_EXPORTS = {
    "ConnectServer": "gym_rpc.server.http._connect",
    "HttpHead": "gym_rpc.server.http._nemo_gym_endpoints",
    "PageServer": "gym_rpc.server.http._status_page",
    "StatusPage": "gym_rpc.server.http._status_page",
}
__all__ = [
    "ConnectServer",
    "HttpHead",
    "PageServer",
    "StatusPage",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
