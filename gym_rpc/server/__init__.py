"""The server layer: the control-plane head and the NeMo Gym bridge, and everything only they run.

* `_head`: the one control-plane server (gRPC server, health, reflection, HTTP head) and `run_head`; `_sources`:
  where its config comes from (a file); `_bridge`: the same server fed by an upstream NeMo Gym head.
* `_servicer`: the ControlPlaneService handlers; `_prober`: the status prober and watch history; `_instances`: a
  server's instances and the one report made from them; `_registry`: registered server instances
  (`_address_policy`: where they may be advertised); `_http_head`: NeMo Gym's HTTP head endpoints (and
  `_status_page`, `_page_feed`: the status page at /ui/ on its port); `_connect`: the
  same service over the Connect protocol (head_server.connect_port); `_engine_load`: the engines' load read from
  their /metrics and pushed down the watches that ask.
* `_security`: the token interceptor, TLS credentials and server bounds; `_tracing`: OpenTelemetry's server
  interceptor.

It may use `gym_rpc.client` (the bridge, a head that asks), never the other way round.
"""

from gym_rpc.server._bridge import BridgeHead, BridgeOptions, parse_listen_address
from gym_rpc.server._head import HeadOptions, HeadServer, build_control_server, run_head
from gym_rpc.server._http_head import HttpHead
from gym_rpc.server._prober import StatusProber
from gym_rpc.server._registry import InstanceRegistry
from gym_rpc.server._security import ServerSecurity
from gym_rpc.server._servicer import ControlPlaneServicer
from gym_rpc.server._sources import FileSource

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
