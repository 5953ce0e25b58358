"""Picking one instance of a replicated server per call: routes, stickiness and failover, the pickers, outlier
ejection, each instance's counts, the engines' load.

No aiohttp and no grpc of its own; the data plane sends what it picks. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.replicas._call_in_flight import RoutedCall as RoutedCall
    from gym_rpc.client.replicas._instance_state import Instance as Instance
    from gym_rpc.client.replicas._outliers import OutlierDetection as OutlierDetection
    from gym_rpc.client.replicas._prompt_key import prompt_key as prompt_key
    from gym_rpc.client.replicas._routing import ROUTINGS as ROUTINGS
    from gym_rpc.client.replicas._routing import Routing as Routing
    from gym_rpc.client.replicas._server_route import ServerRoute as ServerRoute
    from gym_rpc.client.replicas._server_route import session_pin_key as session_pin_key

__getattr__ = lazy_modules(
    __name__,
    {
        "_call_in_flight": "RoutedCall",
        "_instance_state": "Instance",
        "_outliers": "OutlierDetection",
        "_prompt_key": "prompt_key",
        "_routing": "Routing ROUTINGS",
        "_server_route": "ServerRoute session_pin_key",
    },
)
