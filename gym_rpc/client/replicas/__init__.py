"""Picking one instance of a replicated server per call: routes, stickiness and failover, the pickers, outlier
ejection, each instance's counts, the engines' load.

No aiohttp and no grpc of its own; the data plane sends what it picks. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.replicas._instance_state import Instance
    from gym_rpc.client.replicas._outliers import OutlierDetection
    from gym_rpc.client.replicas._prompt_key import prompt_key
    from gym_rpc.client.replicas._routing import ROUTINGS, RoutedCall, Routing, ServerRoute, session_pin_key

_EXPORTS = {
    "Instance": "gym_rpc.client.replicas._instance_state",
    "OutlierDetection": "gym_rpc.client.replicas._outliers",
    "prompt_key": "gym_rpc.client.replicas._prompt_key",
    "RoutedCall": "gym_rpc.client.replicas._routing",
    "Routing": "gym_rpc.client.replicas._routing",
    "ROUTINGS": "gym_rpc.client.replicas._routing",
    "ServerRoute": "gym_rpc.client.replicas._routing",
    "session_pin_key": "gym_rpc.client.replicas._routing",
}
__all__ = [
    "ROUTINGS",
    "Instance",
    "OutlierDetection",
    "RoutedCall",
    "Routing",
    "ServerRoute",
    "prompt_key",
    "session_pin_key",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
