"""ServerClient, which finds Gym servers through the head server and calls them, and server URLs.

`ServerClient` is NeMo Gym's API over three parts with one job each: its endpoints (name -> URL or route,
advertised lookups, the model-server override, replicas and their follower, label selectors:
gym_rpc.client._endpoints), its data plane (the call pipeline over aiohttp, made on the first call:
gym_rpc.client.data.DataPlane) and its head view (config fetch and versions, statuses:
gym_rpc.client.control.HeadView, blocking calls that work with or without an event loop in the calling thread).
The typed GlobalConfig is built once per client, so no call walks the DictConfig. In an `ng_run` deployment the
head is NeMo Gym's HTTP head: the client finds that out once per head address and then asks it as NeMo Gym's own
client does.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional, Self

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_serializer, field_validator

from gym_rpc._environment import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR,
    NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR,
    NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR,
    environment,
)
from gym_rpc._telemetry_switches import TELEMETRY_KEY
from gym_rpc.client._dict_config import (
    GLOBAL_CONFIG_DICT_FIELD,
    DictConfig,
    LazyDictConfigField,
    PendingDictConfig,
    built_dict_config,
    typed_config,
)
from gym_rpc.client._endpoints import Endpoints
from gym_rpc.client.control import HeadView, configured_head_server, injected_config, injected_head_server
from gym_rpc.client.data import (
    RolloutTarget,
    apply_rollout_prefix,
    current_rollout_id,
    rollout_context,
    trace_context_path_segment,
)
from gym_rpc.client.nemo_gym import SESSION_ID_KEY
from gym_rpc.config import (
    BaseServerConfig,
    GlobalConfig,
    ServerConfigLike,
    as_server_config,
    base_url,
    connectable_host,
    url_host,
)
from gym_rpc.errors import UnknownServerError
from gym_rpc.metrics import setup_client_metrics
from gym_rpc.telemetry import setup_tracing
from gym_rpc.wire import TRACEPARENT_PATTERN as _TRACEPARENT_PATTERN
from gym_rpc.wire import ServerStatus, rollout_path_prefix

if TYPE_CHECKING:
    from typing import Unpack

    import aiohttp
    from aiohttp.client import _RequestOptions

    from gym_rpc.client.data import DataPlane, HttpClientSettings, HttpPools
    from gym_rpc.client.replicas import Routing
    from gym_rpc.wire import EngineLoad

__all__ = [
    "NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME",
    "NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR_NAME",
    "NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR_NAME",
    "SESSION_ID_KEY",
    "_TRACEPARENT_PATTERN",
    "RolloutTarget",
    "ServerClient",
    "ServerStatus",
    "_connectable_client_host",
    "apply_rollout_prefix",
    "current_rollout_id",
    "get_server_url",
    "logger",
    "rollout_context",
    "rollout_path_prefix",
    "rollout_target",
    "setup_server_client",
    "trace_context_path_segment",
]

logger = logging.getLogger(__name__)

NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME = NEMO_GYM_CONFIG_DICT_ENV_VAR
NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR_NAME = NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR
NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR_NAME = NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR


def _connectable_client_host(host: str) -> str:
    """Return a connectable client host for a server bind address.

    Ready for `f"http://{host}:{port}"`: wildcards become loopback and IPv6 literals come bracketed ("::" and
    "[::]" give "[::1]")."""
    return url_host(connectable_host(host))


def _new_pools(settings: HttpClientSettings) -> HttpPools:
    """A client's own HttpPools. The data plane's settings (pydantic models) load with the first client made, not
    with this module."""
    from gym_rpc.client.data import HttpPools

    return HttpPools(settings)


def _setup_telemetry(config: GlobalConfig) -> None:
    """Tracing and worker metrics as the environment and the config say (its observability_enabled and NeMo Gym's
    `telemetry:` block): decided per process, by gym_rpc.telemetry and gym_rpc.metrics."""
    block = config.document.get(TELEMETRY_KEY)
    setup_tracing(config.observability_enabled, telemetry_block=block)
    setup_client_metrics(telemetry_block=block)


# The words of the API page for both `get` and `post`.
_CALL_ARGS_DOC = """
Args:
    server_name: str
        The name of the server you are trying to call.
    url_path: str
        The URL path in the server you are trying to call e.g. "/v1/responses".
"""

_DATA_PLANE = "_data_plane"  # ServerClient's cached property
# What a client keeps in its own __dict__ for its calls, made on its first call: never copied or pickled.
_PER_CLIENT_CALLS = (_DATA_PLANE, "post", "get")


def _bind_direct_calls(client: ServerClient, plane: DataPlane) -> None:
    """`client.post` and `client.get` as the data plane's `call` with the method bound, kept in the client's
    `__dict__` (where they win over the class's methods), so `await client.post(...)` runs the pipeline as the
    only coroutine under the caller's: the `async def post` would be a second one, alive as long as the call
    (bench/allocations.py counts what a call keeps alive). The class keeps its `async def`s, for `inspect`,
    `help`, `unittest.mock` and the first call; a subclass with its own `request`, `post` or `get` keeps them
    all."""
    kind = type(client)
    if kind.request is not ServerClient.request:
        return
    for name, method in (("post", "POST"), ("get", "GET")):
        if getattr(kind, name) is getattr(ServerClient, name):
            client.__dict__[name] = functools.partial(type(plane).call, plane, method)


class ServerClient(BaseModel):
    """Finds Gym servers through the head and calls them over the shared data-plane pools.

    Pickles as its head config, typed config, data-plane settings, label selectors and caches, without its live
    state (Ray tasks and actors, multiprocessing): the aiohttp sessions belong to the event loops of the process
    that made them, and the control channel and the follower are the process's own. The receiving process opens
    them on first use. Copies share the config and (shallow) the caches, with pools of their own."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    head_server_config: BaseServerConfig
    global_config_dict: DictConfig = Field(repr=False)  # the whole document, API keys included

    _server_base_urls: dict[str, str] = PrivateAttr(default_factory=dict)
    _checkpoint_enabled: Optional[bool] = PrivateAttr(default=None)  # noqa: UP045 (the seed's spelling)
    _global_config: GlobalConfig = PrivateAttr()
    _http: HttpPools = PrivateAttr()
    _head: HeadView = PrivateAttr()  # config fetch and versions, statuses
    _endpoints: Endpoints = PrivateAttr()  # name -> URL or route

    @field_validator("head_server_config", mode="before")
    @classmethod
    def _any_server_config(cls, value: Any) -> BaseServerConfig:
        """NeMo Gym's own BaseServerConfig, any model or object with host and port, or a mapping."""
        return as_server_config(value)

    def model_post_init(self, context: Any) -> None:
        """Build the typed view every lookup uses, once (or take the one the caller already has), and the parts."""
        given = self.__dict__.get(GLOBAL_CONFIG_DICT_FIELD)
        config = self._global_config = typed_config(given)
        settings = given.settings if isinstance(given, PendingDictConfig) else None
        if settings is None:
            from gym_rpc.client.data import HttpClientSettings

            settings = HttpClientSettings.from_document(config.document)
        self._http = _new_pools(settings)
        self._head = HeadView(self.head_server_config)
        self._endpoints = Endpoints(config, self._head, settings, self._server_base_urls)
        _setup_telemetry(config)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as what it is made from (head config, typed config, data-plane settings) and what it learnt
        (label selectors, caches), never its live state: sessions, routes and follower are this process's."""
        fields = {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name not in ("head_server_config", GLOBAL_CONFIG_DICT_FIELD)
        }
        state = {
            "head_server_config": self.head_server_config,
            "fields": fields,
            "global_config_dict": built_dict_config(self),  # None while pending: built from the typed config
            "global_config": self._global_config,
            "http_settings": self._http.settings,
            "endpoints": self._endpoints.portable(),
            "checkpoint_enabled": self._checkpoint_enabled,
        }
        return (_unpickled, (type(self), state))

    def __copy__(self) -> Self:
        """A shallow copy sharing config and caches, with its own HttpPools."""
        clone = super().__copy__()
        for key in _PER_CLIENT_CALLS:
            vars(clone).pop(key, None)
        clone._http = _new_pools(self._http.settings)
        clone._endpoints = copy.copy(self._endpoints)  # its own attributes, the same caches and routes
        return clone

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        """A deep copy of config and caches; the live HttpPools is replaced, never copied."""
        memo = {} if memo is None else memo
        memo[id(self._http)] = _new_pools(self._http.settings)
        endpoints = self._endpoints
        for live in (endpoints.routing, endpoints.pending, *(vars(self).get(key) for key in _PER_CLIENT_CALLS)):
            if live is not None:
                memo[id(live)] = None  # the copy makes its own routes and calls on its first call
        clone = super().__deepcopy__(memo)
        for key in _PER_CLIENT_CALLS:
            vars(clone).pop(key, None)
        return clone

    @functools.cached_property
    def _data_plane(self) -> DataPlane:
        """The call pipeline, made on the first call (aiohttp loads then, not with this module)."""
        from gym_rpc.client.data import DataPlane

        plane = DataPlane(self._endpoints, self._http)
        _bind_direct_calls(self, plane)
        return plane

    @field_serializer(GLOBAL_CONFIG_DICT_FIELD)
    def _dump_global_config_dict(self, value: Any) -> DictConfig:
        """model_dump() shows the DictConfig, never the stand-in."""
        return self.global_config_dict

    @classmethod
    def _from_global_config(cls, head_server_config: BaseServerConfig, config: GlobalConfig) -> ServerClient:
        """A client on an already validated config; its DictConfig is built when first read."""
        return cls.model_construct(
            head_server_config=as_server_config(head_server_config), global_config_dict=PendingDictConfig(config)
        )

    @classmethod
    def load_head_server_config(cls) -> BaseServerConfig:
        """The injected config's head_server, else GYM_RPC_HEAD (HOST:PORT), else 127.0.0.1:11000."""
        return configured_head_server()

    @classmethod
    def load_from_global_config(cls, head_server_config: Optional[ServerConfigLike] = None) -> ServerClient:  # noqa: UP045
        """Build a client from the fully resolved global config.

        Gym-launched server processes reuse the config injected by their parent. Other processes fetch the config
        from the head server.

        `head_server_config` may be gym_rpc's BaseServerConfig, NeMo Gym's, any object with host and port (and
        optionally auth_token, tls), or a mapping.
        """
        given = None if head_server_config is None else as_server_config(head_server_config)
        injected = injected_config()
        if injected is not None:
            client = cls._from_global_config(given or injected_head_server(injected), injected)
            client._endpoints.asks_head = False
            return client
        head = given or cls.load_head_server_config()
        # Token and TLS from head_server (auth_token, tls) or the environment. With the head's token the client
        # is authenticated and gets the secrets (API keys) its server needs; without one they stay redacted.
        # Making the client decides tracing with the config's observability_enabled.
        return HeadView(head).fetch_config(lambda config: cls._from_global_config(head, config))

    def _build_server_base_url(self, server_config_dict: Any) -> str:
        """http://host:port of a server entry (a mapping or an object with host and port)."""
        if isinstance(server_config_dict, Mapping):
            host, port = server_config_dict["host"], server_config_dict["port"]
        else:
            host, port = server_config_dict.host, server_config_dict.port
        return base_url(self._client_host(str(host)), int(port))

    @staticmethod
    def _client_host(host: str) -> str:
        """Return a connectable host for a server bind address.

        Wildcard addresses are valid for binding a server but are not valid advertised client targets. In
        particular, proxy-aware HTTP clients can route 0.0.0.0 through an external proxy instead of reaching the
        local server. IPv6 literals come bracketed, ready for a URL.
        """
        return _connectable_client_host(host)

    def _resolve_base_url(self, server_name: str) -> str:
        """The server's base URL, resolved once and cached.

        A server whose config host is a wildcard (0.0.0.0, ::) is dialled where it registered with the head. Until
        the head knows that address it is dialled on loopback, uncached, and the head is asked again at most every
        ADVERTISED_RETRY_SECONDS. A client made from an injected config never asks: loopback, cached. A server
        with several instances: the current rollout's instance, else a healthy one.
        Blocking when the head is asked: from an event loop use `_aresolve_base_url`.
        """
        return self._endpoints.resolve(server_name)

    async def _aresolve_base_url(self, server_name: str) -> str:
        """`_resolve_base_url` for the event loop: a call to the head runs in a thread, never in the loop."""
        return await self._endpoints.aresolve(server_name)

    def rollout_target(
        self, server_name: str, rollout_id: str | None, token_capture: bool = False, trace_context: bool = True
    ) -> RolloutTarget:
        """The base URL and headers for a rollout's calls to `server_name` made by a client Gym does not instrument
        (an OpenAI client: `AsyncOpenAI(base_url=target.url + "/v1", default_headers=target.headers)`), by the
        entry's form. A Gym server: `apply_rollout_prefix(url, rollout_id, ...)` and no header. An engine or router
        (`session_affinity_header`): its URL as it is, the rollout id in its header and, while traces export, the
        trace context in `traceparent`; it has no training-token-capture path, so `token_capture` is a
        ValueError there. Blocking, as `_resolve_base_url`; trace_context=False as for apply_rollout_prefix."""
        return self._endpoints.rollout_target(server_name, rollout_id, token_capture, trace_context)

    def lookup_registered_servers(self) -> dict[str, str]:
        """Ask the head now where servers registered and dial wildcard-bound ones there: name -> advertised URL
        of each server registered at one address; a server of several instances is routed over all of them.

        The explicit lookup for a client made from an injected `NEMO_GYM_CONFIG_DICT`, which otherwise never asks
        the head; any client may call it to pick up registrations at once. Blocking (one bounded call, a head that
        cannot say adds nothing): from an event loop, run it with `asyncio.to_thread`.
        """
        return self._endpoints.lookup_registered_servers()

    # --- replicas: routes to servers with several instances (docs/replicas.md) ---

    @property
    def _routing(self) -> Routing | None:
        """This process's routes for the client (gym_rpc.client.replicas); None before its first call here."""
        return self._endpoints.routing

    def require_labels(self, server_name: str, labels: Mapping[str, str] | None) -> None:
        """Send new rollouts and calls of no rollout for `server_name` only to its instances whose labels carry
        every `key=value` of `labels` (None: any instance again), e.g. `{"weights_version": "43"}` after a weight
        refit. Rollouts already pinned to an instance finish there. A call that no instance can take then fails
        with NoHealthyInstanceError naming each instance's labels. For this client, in every process it is
        pickled to."""
        self._endpoints.require_labels(server_name, labels)

    def engine_loads(self, server_name: str) -> dict[str, EngineLoad]:
        """instance id -> the load the head last read from each engine instance of `server_name` (an entry with
        `session_affinity_header`) and pushed to this process: requests waiting and running, KV-cache use, and
        its age. An instance whose load is unknown (never read, or older than ENGINE_LOAD_MAX_AGE_SECONDS) is
        left out; a figure the engine does not report is None. Empty for other servers and for a client that does
        not follow the head. No I/O."""
        return self._endpoints.engine_loads(server_name)

    def follow_instances(self, follow: bool = True) -> None:
        """Follow the head's instances (its status watch, in the background) from now on, or (False) stop. A
        client that asks the head follows by default; one made from an injected NEMO_GYM_CONFIG_DICT never asks
        the head by itself, and knows only the config's static replicas (and those `lookup_registered_servers()`
        found) until this is called."""
        self._endpoints.follow_instances(follow)

    # --- the data plane ---

    async def request(
        self,
        server_name: str,
        url_path: str,
        method: str,
        _control: bool = False,
        _resend_after_disconnect: bool = True,
        **kwargs: Unpack[_RequestOptions],
    ) -> aiohttp.ClientResponse:
        """Call another server. _control sends the call over the reserved control pool.

        The caller reads and releases the response, as with aiohttp. A server with several instances
        (docs/replicas.md) is called at the one its rollout sticks to, else at the less loaded of two healthy ones.
        """
        return await self._data_plane.call(
            method, server_name, url_path, _control, _resend_after_disconnect, **kwargs
        )

    # As in NeMo Gym, `get` and `post` are `request` (a subclass's own too). These run on a client's first call and
    # for a subclass with its own `request`, `post` or `get`; a plain client's later calls are the data plane's
    # (_bind_direct_calls).
    async def get(
        self, server_name: str, url_path: str, **kwargs: Unpack[_RequestOptions]
    ) -> aiohttp.ClientResponse:
        return await self.request(server_name, url_path, "GET", **kwargs)

    async def post(
        self, server_name: str, url_path: str, **kwargs: Unpack[_RequestOptions]
    ) -> aiohttp.ClientResponse:
        return await self.request(server_name, url_path, "POST", **kwargs)

    get.__doc__ = post.__doc__ = _CALL_ARGS_DOC

    async def aclose(self) -> None:
        """Close the running loop's data and control sessions (shared with clients of the same settings)."""
        await self._http.close()

    # --- the head ---

    def poll_for_status(self, server_name: str, timeout_seconds: float = 5) -> ServerStatus:
        """The server's status as the head probes it within `timeout_seconds`; the head's own name asks the head's
        health service. While the head is unreachable, the server is probed directly (as NeMo Gym always does),
        and the log says the head was skipped. A NeMo Gym HTTP head keeps no statuses: there every poll is one
        direct probe, as with NeMo Gym's own client. Blocking; safe with or without a loop."""
        return self._head.poll_for_status(server_name, timeout_seconds, self._direct_probe_url)

    def _direct_probe_url(self, server_name: str) -> str:
        entry = self._global_config.server(server_name)  # unknown: UnknownServerError, a KeyError
        return self._server_base_urls.get(server_name) or entry.url

    def _config_if_changed(self) -> GlobalConfig | None:
        """The head's config when its version differs from this client's; None (nothing sent) when unchanged."""
        return self._head.config_if_changed(self._global_config.version)

    def checkpoint_enabled(self) -> bool:
        """Return whether the global checkpoint: block enables partial-rollout checkpointing."""
        if self._checkpoint_enabled is None:
            self._checkpoint_enabled = self._global_config.checkpoint_enabled
        return self._checkpoint_enabled

    def assistant_message_header(self, model_server_name: str) -> bytes | None:
        """Read the optional header property of harnesses using this model server.

        The property lives on the harness package so model workers need not import an agent's app or install its
        runtime dependencies.
        """
        config = self._global_config
        if model_server_name not in config.servers:
            raise UnknownServerError(model_server_name, list(config.servers))
        return config.assistant_message_header(model_server_name)


# Set after the class is made: pydantic keeps the field (required, typed DictConfig) and reads go through this.
ServerClient.global_config_dict = LazyDictConfigField()  # type: ignore[assignment]


def _unpickled(kind: type[ServerClient], state: dict[str, Any]) -> ServerClient:
    """A client from what `ServerClient.__reduce__` gave, in the receiving process: its own pools, routes and
    control channel, made on first use; telemetry decided here too (by model_post_init)."""
    pending = PendingDictConfig(state["global_config"], state["http_settings"])
    client = kind.model_construct(
        head_server_config=state["head_server_config"], global_config_dict=pending, **state["fields"]
    )
    if state["global_config_dict"] is not None:
        vars(client)[GLOBAL_CONFIG_DICT_FIELD] = state["global_config_dict"]
    client._checkpoint_enabled = state["checkpoint_enabled"]
    client._endpoints.restore(state["endpoints"])
    return client


_clients: dict[tuple[str, int] | None, ServerClient] = {}
_clients_lock = threading.Lock()


def setup_server_client(head_server_config: Optional[ServerConfigLike] = None) -> ServerClient:  # noqa: UP045
    """The process's client for a head (the default head when None), never with a stale config.

    Every call checks the config, as NeMo Gym's fetches it afresh: a config injected in NEMO_GYM_CONFIG_DICT is
    read again; from a head, the client asks whether its config version is still current (GetGlobalConfig with
    `known_version`: no document travels while unchanged). While nothing changed it returns the same client, so
    its resolved URLs and pools stay warm; after the head reloads or the injected config changes, a new client."""
    head = None if head_server_config is None else as_server_config(head_server_config)
    key = None if head is None else (head.host, head.port)
    with _clients_lock:
        cached = _clients.get(key)
    fresh: ServerClient | None = None
    injected = environment().nemo_gym_config_dict is not None
    if cached is not None and not injected and cached.head_server_config == (head or _default_head()):
        changed = cached._config_if_changed()
        if changed is None:
            return cached
        fresh = ServerClient._from_global_config(cached.head_server_config, changed)
    if fresh is None:
        fresh = ServerClient.load_from_global_config(head)
    with _clients_lock:
        cached = _clients.get(key)
        if (
            cached is not None
            and cached._global_config.version == fresh._global_config.version
            and cached.head_server_config == fresh.head_server_config
        ):
            return cached
        _clients[key] = fresh
        return fresh


def _default_head() -> BaseServerConfig:
    return ServerClient.load_head_server_config()


def get_server_url(server_name: str) -> str:
    """The server's base URL: NEMO_GYM_MODEL_SERVER_BASE_URL when NEMO_GYM_MODEL_SERVER_NAME names this server
    (a harness where the head is unreachable), else from the global config."""
    override = environment().model_server_override(server_name)
    return override if override is not None else setup_server_client()._resolve_base_url(server_name)


def rollout_target(
    server_name: str, rollout_id: str | None, token_capture: bool = False, trace_context: bool = True
) -> RolloutTarget:
    """`get_server_url` and `apply_rollout_prefix` in one, by the server's form (`ServerClient.rollout_target`):
    the URL and headers a client Gym does not instrument sends a rollout's calls with. A launcher's
    NEMO_GYM_MODEL_SERVER_BASE_URL is returned as given, with no header."""
    override = environment().model_server_override(server_name)
    if override is not None:
        return RolloutTarget(override, {})
    return setup_server_client().rollout_target(server_name, rollout_id, token_capture, trace_context)
