"""The server layer: the control-plane head and the NeMo Gym bridge, and everything only they run.

* `_head`: the one control-plane server (gRPC server, health, reflection, HTTP head) and `run_head`; `_sources`:
  where its config comes from (a file); `_bridge`: the same server fed by an upstream NeMo Gym head.
* `http`: the HTTP side (NeMo Gym's HTTP head endpoints, the status page at /ui/, the Connect protocol);
  `service`: the ControlPlaneService handlers both protocols serve, and grpc.health.
* `registry`: registered server instances, their caps and the file that keeps them; `fleet`: what the head knows
  of its servers (instances, the prober, revisions and watch pushes, engines' load, the events operators grep for).
* `observability`: the head's metrics and /metrics, OpenTelemetry's server interceptor; `security`: the token
  interceptor, TLS credentials and the server's bounds (connections, Host names, addresses, watch slots).

`make lint` keeps the families in layers (head > http > service > registry > fleet > observability > security).
It may use `gym_rpc.client` (the bridge, a head that asks), never the other way round.
"""

from gym_rpc.server._bridge import BridgeHead, BridgeOptions, parse_listen_address
from gym_rpc.server._head import HeadOptions, HeadServer, build_control_server, run_head
from gym_rpc.server._sources import FileSource
from gym_rpc.server.fleet import StatusProber
from gym_rpc.server.http import HttpHead
from gym_rpc.server.registry import InstanceRegistry
from gym_rpc.server.security import ServerSecurity
from gym_rpc.server.service import ControlPlaneServicer

__all__ = [
    "BridgeHead",
    "BridgeOptions",
    "ControlPlaneServicer",
    "FileSource",
    "HeadOptions",
    "HeadServer",
    "HttpHead",
    "InstanceRegistry",
    "ServerSecurity",
    "StatusProber",
    "build_control_server",
    "parse_listen_address",
    "run_head",
]
