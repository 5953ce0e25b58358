"""A node's watch relay (`gym-rpc relay`): follows the head's status watch once and serves it to the node's own
processes, so the head holds one stream per node instead of one per worker process (docs/multi-host.md,
"Running a fleet")."""

from gym_rpc.server.watch_relay._mirror import StatusMirror as StatusMirror
from gym_rpc.server.watch_relay._relay import DEFAULT_LISTEN as DEFAULT_LISTEN
from gym_rpc.server.watch_relay._relay import DEFAULT_RELAY_PORT as DEFAULT_RELAY_PORT
from gym_rpc.server.watch_relay._relay import WatchRelay as WatchRelay
from gym_rpc.server.watch_relay._relay import checked_listen_address as checked_listen_address
from gym_rpc.server.watch_relay._relay import run_relay as run_relay
