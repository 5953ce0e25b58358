"""What the head knows of its servers: each server's instances and its one report, the prober (status cache,
revisions, watch history), when changes are pushed, the watch messages built once for every watcher, the
engines' load, and the log lines operators grep for (`events`, a public module)."""

from gym_rpc.server.fleet._engine_load import EngineLoads as EngineLoads
from gym_rpc.server.fleet._engine_load import LoadPush as LoadPush
from gym_rpc.server.fleet._engine_load import engine_targets as engine_targets
from gym_rpc.server.fleet._prober import Changes as Changes
from gym_rpc.server.fleet._prober import StatusProber as StatusProber
from gym_rpc.server.fleet._prober import changes_in_history as changes_in_history
from gym_rpc.server.fleet._pushes import DEFAULT_MAX_DELAY_SECONDS as DEFAULT_MAX_DELAY_SECONDS
from gym_rpc.server.fleet._pushes import DEFAULT_QUIET_SECONDS as DEFAULT_QUIET_SECONDS
from gym_rpc.server.fleet._pushes import MAX_PUSH_DELAY_SECONDS as MAX_PUSH_DELAY_SECONDS
from gym_rpc.server.fleet._pushes import Pushes as Pushes
from gym_rpc.server.fleet._server_instances import InstanceTarget as InstanceTarget
from gym_rpc.server.fleet._server_instances import config_targets as config_targets
from gym_rpc.server.fleet._server_instances import serves as serves
from gym_rpc.server.fleet._watch_feed import ReportMessages as ReportMessages
from gym_rpc.server.fleet._watch_feed import WatchedStatuses as WatchedStatuses
from gym_rpc.server.fleet._watch_feed import WatchFeed as WatchFeed
