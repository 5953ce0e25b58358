"""ServerClient, which finds Gym servers through the head server and calls them, and server URLs.

The control plane (config, status) goes to the head over gRPC with blocking calls that work with or without an
event loop in the calling thread; the data plane goes to Gym servers over aiohttp (gym_rpc.client.data._http). The
typed GlobalConfig is built once per client, so no call walks the DictConfig. In an `ng_run` deployment the head
is NeMo Gym's HTTP head: the client finds that out once per head address and then asks it as NeMo Gym's own
client does (the config from its HTTP endpoint, statuses probed directly).
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    PrivateAttr,
    field_serializer,
    field_validator,
)
from pydantic_core import core_schema

from gym_rpc._environment import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR,
    NEMO_GYM_MODEL_SERVER_BASE_URL_ENV_VAR,
    NEMO_GYM_MODEL_SERVER_NAME_ENV_VAR,
    environment,
)
from gym_rpc._telemetry_switches import TELEMETRY_KEY
from gym_rpc.client.control import ClientSecurity, client_security
from gym_rpc.client.data import (
    RolloutTarget,
    apply_rollout_prefix,
    current_rollout_id,
    rollout_context,
    rollout_headers,
    rollout_id_in_context,
    trace_context_path_segment,
)
from gym_rpc.client.nemo_gym import SESSION_ID_KEY, nemo_gym_rollout_id
from gym_rpc.client.resend import BACKPRESSURE_STATUSES
from gym_rpc.config import (
    DEFAULT_HEAD_HOST,
    DEFAULT_HEAD_PORT,
    HEAD_SERVER_KEY,
    BaseServerConfig,
    GlobalConfig,
    ServerConfigLike,
    as_server_config,
    base_url,
    connectable_host,
    is_wildcard_host,
    parse_config_text,
    parse_head_addresses,
    parse_host_port,
    url_host,
)
from gym_rpc.errors import (
    ConfigError,
    ControlPlaneError,
    GymRpcError,
    HeadTimeoutError,
    HeadUnreachableError,
    UnknownServerError,
)
from gym_rpc.metrics import METRICS, setup_client_metrics
from gym_rpc.telemetry import TRACING, setup_tracing
from gym_rpc.wire import (
    HEAD_ADDRESS_ENV_VAR,
    ServerStatus,
    rollout_path_prefix,
)
from gym_rpc.wire import (
    TRACEPARENT_PATTERN as _TRACEPARENT_PATTERN,
)

if TYPE_CHECKING:
    from typing import Unpack

    import aiohttp
    from aiohttp.client import _RequestOptions
    from omegaconf import DictConfig

    from gym_rpc.client._follower import InstanceFollower
    from gym_rpc.client.control import SyncControlClient
    from gym_rpc.client.data import HttpClientSettings, HttpPools
    from gym_rpc.client.replicas import Routing
    from gym_rpc.wire import EngineLoad, ServerInstance

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

_GLOBAL_CONFIG_DICT_FIELD = "global_config_dict"
# Where a pickled client keeps its data-plane settings in place of its live HttpPools.
_HTTP_SETTINGS_STATE_KEY = "gym_rpc_http_settings"
# Bound on the one ListServerInstances call a client makes to learn where wildcard-bound servers registered.
ADVERTISED_LOOKUP_TIMEOUT_SECONDS = 2.0
# A wildcard-bound server not registered yet (or a head that could not say) is dialled on loopback meanwhile and
# asked about again at most this often, so a server registering after the client started is still found.
ADVERTISED_RETRY_SECONDS = 5.0
_advertised_lock = threading.Lock()
# How long a client's first call waits for the head's first list of instances (once per client and process), so
# that a rollout's first call is pinned where its later ones will go. A head that is not there ends the wait.
FIRST_INSTANCES_WAIT_SECONDS = 1.0
_routing_lock = threading.Lock()


if not TYPE_CHECKING:

    class DictConfig:
        """`global_config_dict`'s type for pydantic: an OmegaConf DictConfig, checked without importing OmegaConf
        (about 85 ms) until a process holds one. Type checkers see omegaconf.DictConfig itself."""

        @classmethod
        def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
            return core_schema.no_info_plain_validator_function(_dict_config)


def _dict_config(value: Any) -> DictConfig:
    if "omegaconf" in sys.modules:  # a DictConfig exists only once OmegaConf is imported
        from omegaconf import DictConfig

        if isinstance(value, DictConfig):
            return value
    raise ValueError(f"global_config_dict must be an OmegaConf DictConfig, not {type(value).__name__}")


class _PendingDictConfig:
    """Stands in the instance's `__dict__` for a `global_config_dict` not built yet.

    Building an OmegaConf DictConfig costs over 100 ms for 200 server entries (a node per value) and no flag
    skips that path, while the client itself only needs the typed GlobalConfig. So a client made from a config it
    already has keeps the GlobalConfig here and builds the DictConfig on first read of the field.
    """

    __slots__ = ("config",)

    def __init__(self, config: GlobalConfig) -> None:
        self.config = config

    def __repr__(self) -> str:
        return f"<DictConfig of {len(self.config.document)} keys, built on first access>"


class _LazyDictConfigField:
    """Data descriptor for the `global_config_dict` field: builds the DictConfig on first access, then caches it
    in the instance's `__dict__` (where pydantic keeps field values), so later reads cost a dict lookup."""

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:  # as for pydantic's own fields; a default here would be a default to subclasses
            raise AttributeError(_GLOBAL_CONFIG_DICT_FIELD)
        value = instance.__dict__.get(_GLOBAL_CONFIG_DICT_FIELD)
        if isinstance(value, _PendingDictConfig):
            from omegaconf import OmegaConf

            value = instance.__dict__[_GLOBAL_CONFIG_DICT_FIELD] = OmegaConf.create(value.config.document)
        return value

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[_GLOBAL_CONFIG_DICT_FIELD] = value


def _new_pools(settings: HttpClientSettings) -> HttpPools:
    """A client's own HttpPools. The data plane's settings (pydantic models) load with the first client made, not
    with this module."""
    from gym_rpc.client.data import HttpPools

    return HttpPools(settings)


# The least time a direct status probe gets when the head's attempt used up the caller's timeout.
_MIN_DIRECT_PROBE_SECONDS = 0.1


def _connectable_client_host(host: str) -> str:
    """Return a connectable client host for a server bind address.

    Ready for `f"http://{host}:{port}"`: wildcards become loopback and IPv6 literals come bracketed ("::" and
    "[::]" give "[::1]")."""
    return url_host(connectable_host(host))


def _injected_config() -> GlobalConfig | None:
    """The config a parent injected in NEMO_GYM_CONFIG_DICT (YAML or JSON text), or None when not set.

    Interpolations nothing reads stay unresolved (GlobalConfig.from_document, lenient), as in NeMo Gym."""
    text = environment().nemo_gym_config_dict
    if not text:
        return None
    document: Any = None
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)  # far faster than YAML for the large documents launchers inject
        except ValueError:
            document = None  # maybe YAML flow style: the YAML parser below reports real errors
    if document is None:
        document = parse_config_text(text, NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME)
    return GlobalConfig.from_document(document, lenient=True)


def _injected_head_server(injected: GlobalConfig) -> BaseServerConfig:
    """The injected config's head_server: a config injected without one is an error, never a silent default."""
    if HEAD_SERVER_KEY not in injected.document:
        raise ConfigError(
            f"the config injected in {NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME} has no {HEAD_SERVER_KEY} "
            f"(host and port of the head): add it, or pass head_server_config"
        )
    return injected.head_server


def _model_server_override(server_name: str) -> str | None:
    """NEMO_GYM_MODEL_SERVER_BASE_URL when NEMO_GYM_MODEL_SERVER_NAME names `server_name`: the URL a launcher gave
    a harness it started where the head is unreachable, rollout prefix included (it binds no rollout context)."""
    override = environment().model_server_override(server_name)
    return override.rstrip("/") if override is not None else None


def _head_server_from_address(address: str) -> BaseServerConfig:
    """HOST:PORT (IPv6 bracketed) as a head server config; several (`a:11000,b:11000`) as the first one's, with
    every one in `addresses` (docs/multi-host.md, "Several heads")."""
    if "," in address:
        addresses = parse_head_addresses(address, HEAD_ADDRESS_ENV_VAR)
        host, port = parse_host_port(addresses[0], HEAD_ADDRESS_ENV_VAR)
        return BaseServerConfig.model_validate({"host": host, "port": port, "addresses": list(addresses)})
    host, port = parse_host_port(address, HEAD_ADDRESS_ENV_VAR)
    return BaseServerConfig(host=host, port=port)


# The words of the API page for both `get` and `post`.
_CALL_ARGS_DOC = """
Args:
    server_name: str
        The name of the server you are trying to call.
    url_path: str
        The URL path in the server you are trying to call e.g. "/v1/responses".
"""


def _setup_telemetry(config: GlobalConfig) -> None:
    """Tracing and worker metrics as the environment and the config say (its observability_enabled and NeMo Gym's
    `telemetry:` block): decided per process, by gym_rpc.telemetry and gym_rpc.metrics."""
    block = config.document.get(TELEMETRY_KEY)
    setup_tracing(config.observability_enabled, telemetry_block=block)
    setup_client_metrics(telemetry_block=block)


_DATA_PLANE = "_data_plane"  # ServerClient's cached property: see _DataPlane
# What a client keeps in its own __dict__ for its calls, made on its first call: never copied or pickled.
_PER_CLIENT_CALLS = (_DATA_PLANE, "post", "get")


def _bind_direct_calls(client: ServerClient) -> None:
    """`client.post` and `client.get` as `_call` with the client and the method bound, kept in the client's
    `__dict__` (where they win over the class's methods), so `await client.post(...)` runs the hot path as the
    only coroutine of ServerClient's under the caller's: the `async def post` would be a second one, alive as long
    as the call (bench/allocations.py counts what a call keeps alive: as many objects as raw aiohttp with this,
    one more without). The class keeps its `async def`s, for `inspect`, `help`, `unittest.mock` and the first
    call; a subclass with its own `request`, `post` or `get` keeps them all."""
    kind = type(client)
    if kind.request is not ServerClient.request:
        return
    for name, method in (("post", "POST"), ("get", "GET")):
        if getattr(kind, name) is getattr(ServerClient, name):
            client.__dict__[name] = functools.partial(kind._call, client, method)


class _DataPlane:
    """What `ServerClient.request` reads on every call, in one plain object made on the client's first call (its
    `_data_plane`, a cached property: after the first call one ordinary attribute read).

    Two costs kept off the hot path, on public API only: each read of a pydantic private attribute (`self._x`)
    misses the instance and goes through BaseModel.__getattr__ (about 1.5 µs, the "hot path" rows of
    bench/hot_path.py), and aiohttp with the data plane's modules (replicas routing included) is imported here, on
    the first call, not with server_client (a process that only asks the head never loads it). It refers to the
    client's own `_server_base_urls`, `_global_config`, `_http` and (once the first call made it) `_routing`,
    which are never rebound once set; a copy or an unpickled client gets its own (ServerClient drops this object
    from what it copies and pickles)."""

    __slots__ = (
        "backpressure",
        "base_urls",
        "call_span",
        "config",
        "json_payload",
        "metered_send",
        "path_rule",
        "pools",
        "resend_after_failure",
        "routing",
        "send",
        "send_routed",
        "sticky_keys",
    )

    def __init__(
        self, base_urls: dict[str, str], config: GlobalConfig, pools: HttpPools, routing: Routing | None
    ) -> None:
        from gym_rpc.client import data, resend

        self.base_urls = base_urls
        # Where calls carry their rollout (None: nowhere, no observability and no engine entry), decided once.
        self.path_rule = data.path_rule(config)
        self.config = config
        self.pools = pools
        self.routing = routing  # None until `request` has waited for the head's first list of instances
        self.resend_after_failure = resend.resend_after_failure
        self.backpressure = resend.Backpressure
        self.json_payload = data.json_payload
        self.send = data.send
        self.call_span = data.call_span
        self.metered_send = data.metered_send
        self.send_routed = data.send_routed
        self.sticky_keys = data.sticky_keys


class ServerClient(BaseModel):
    """Finds Gym servers through the head and calls them over the shared data-plane pools.

    Pickles and copies (Ray tasks and actors, multiprocessing) with its config and caches but without its live
    state: the aiohttp sessions belong to the event loops of the process that made them, and the control channel
    is the process's own. The receiving process opens both on first use."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    head_server_config: BaseServerConfig
    global_config_dict: DictConfig = Field(repr=False)  # the whole document, API keys included

    _server_base_urls: dict[str, str] = PrivateAttr(default_factory=dict)
    _checkpoint_enabled: Optional[bool] = PrivateAttr(default=None)  # noqa: UP045 (the seed's spelling)
    _global_config: GlobalConfig = PrivateAttr()
    _http: HttpPools = PrivateAttr()
    # name -> advertised URL of the servers that registered with the head; None until first needed.
    _advertised_urls: Optional[dict[str, str]] = PrivateAttr(default=None)  # noqa: UP045 (as the fields above)
    _advertised_fetched_at: float = PrivateAttr(default=0.0)  # wall clock (it crosses processes), 0: never
    # False for a client made from an injected NEMO_GYM_CONFIG_DICT: such a process never asks the head by itself
    # (SECURITY.md); its wildcard-bound servers are dialled on loopback until lookup_registered_servers().
    _asks_head: bool = PrivateAttr(default=True)
    # Token and TLS for calls to the head, read once (TLS files included) rather than per poll.
    _security: Optional[ClientSecurity] = PrivateAttr(default=None)  # noqa: UP045 (as the fields above)
    # Routes to replicated servers (gym_rpc.client.replicas._routing), made on this process's first call: None
    # until then, and again in a process that unpickled the client (its follower of the head is this process's
    # own).
    _routing: Optional[Routing] = PrivateAttr(default=None)  # noqa: UP045 (as the fields above)
    # The routes, and their follower of the head (gym_rpc.client._follower.InstanceFollower) or None, once made.
    _pending_routing: Optional[tuple[Routing, Any]] = PrivateAttr(default=None)  # noqa: UP045
    # server name -> the labels its instances must carry for new work (`require_labels`); travels with pickles.
    _label_selectors: dict[str, dict[str, str]] = PrivateAttr(default_factory=dict)
    # Whether the client follows the head's instances: by default when it asks the head (`_asks_head`).
    _follows_instances: Optional[bool] = PrivateAttr(default=None)  # noqa: UP045 (as the fields above)

    @field_validator("head_server_config", mode="before")
    @classmethod
    def _any_server_config(cls, value: Any) -> BaseServerConfig:
        """NeMo Gym's own BaseServerConfig, any model or object with host and port, or a mapping."""
        return as_server_config(value)

    def model_post_init(self, context: Any) -> None:
        """Build the typed view every lookup uses, once (or take the one the caller already has)."""
        pending = self.__dict__.get(_GLOBAL_CONFIG_DICT_FIELD)
        if isinstance(pending, _PendingDictConfig):
            config = pending.config
        else:
            from omegaconf import OmegaConf  # loaded already: the caller passed a DictConfig

            # Unresolved: interpolations are resolved leniently below, so an unused `${oc.env:UNSET}` cannot fail.
            document = OmegaConf.to_container(self.global_config_dict, resolve=False)
            if not isinstance(document, dict):
                raise ConfigError("global_config_dict must be a mapping")
            config = GlobalConfig.from_document({str(k): v for k, v in document.items()}, lenient=True)
        self._global_config = config
        from gym_rpc.client.data import HttpClientSettings

        self._http = _new_pools(HttpClientSettings.from_document(config.document))
        _setup_telemetry(config)

    def __getstate__(self) -> dict[Any, Any]:
        """Pickle without the live HttpPools (its sessions are this process's), keeping its settings."""
        state = super().__getstate__()
        state["__dict__"] = {k: v for k, v in state["__dict__"].items() if k not in _PER_CLIENT_CALLS}
        private = dict(state["__pydantic_private__"] or {})
        pools: HttpPools = private.pop("_http")
        private["_routing"] = private["_pending_routing"] = None  # this process's routes and follower stay here
        state["__pydantic_private__"] = private
        state[_HTTP_SETTINGS_STATE_KEY] = pools.settings
        return state

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """Unpickle with fresh HttpPools: sessions and the control channel are opened on first use here."""
        state = dict(state)
        settings: HttpClientSettings = state.pop(_HTTP_SETTINGS_STATE_KEY)
        state["__pydantic_private__"] = {**(state["__pydantic_private__"] or {}), "_http": _new_pools(settings)}
        super().__setstate__(state)
        _setup_telemetry(self._global_config)  # a new process decides too
        named = environment().model_server_name
        if named and _model_server_override(named) is not None:
            self._server_base_urls.pop(named, None)  # this process's launcher URL wins over the sender's cache

    def __copy__(self) -> Self:
        """A shallow copy sharing config and caches, with its own HttpPools."""
        clone = super().__copy__()
        for key in _PER_CLIENT_CALLS:
            vars(clone).pop(key, None)
        clone._http = _new_pools(self._http.settings)
        return clone

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> Self:
        """A deep copy of config and caches; the live HttpPools is replaced, never copied."""
        memo = {} if memo is None else memo
        memo[id(self._http)] = _new_pools(self._http.settings)
        for live in (self._routing, self._pending_routing, *(vars(self).get(key) for key in _PER_CLIENT_CALLS)):
            if live is not None:
                memo[id(live)] = None  # the copy makes its own routes and calls on its first call
        clone = super().__deepcopy__(memo)
        for key in _PER_CLIENT_CALLS:
            vars(clone).pop(key, None)
        return clone

    @functools.cached_property
    def _data_plane(self) -> _DataPlane:
        _bind_direct_calls(self)
        return _DataPlane(self._server_base_urls, self._global_config, self._http, self._routing)

    @field_serializer(_GLOBAL_CONFIG_DICT_FIELD)
    def _dump_global_config_dict(self, value: Any) -> DictConfig:
        """model_dump() shows the DictConfig, never the stand-in."""
        return self.global_config_dict

    @classmethod
    def _from_global_config(cls, head_server_config: BaseServerConfig, config: GlobalConfig) -> ServerClient:
        """A client on an already validated config; its DictConfig is built when first read."""
        return cls.model_construct(
            head_server_config=as_server_config(head_server_config), global_config_dict=_PendingDictConfig(config)
        )

    @classmethod
    def load_head_server_config(cls) -> BaseServerConfig:
        """The injected config's head_server, else GYM_RPC_HEAD (HOST:PORT), else 127.0.0.1:11000."""
        injected = _injected_config()
        if injected is not None:
            return _injected_head_server(injected)
        address = environment().head_address
        if address:
            return _head_server_from_address(address)
        return BaseServerConfig(host=DEFAULT_HEAD_HOST, port=DEFAULT_HEAD_PORT)

    @classmethod
    def load_from_global_config(cls, head_server_config: Optional[ServerConfigLike] = None) -> ServerClient:  # noqa: UP045
        """Build a client from the fully resolved global config.

        Gym-launched server processes reuse the config injected by their parent. Other processes fetch the config
        from the head server.

        `head_server_config` may be gym_rpc's BaseServerConfig, NeMo Gym's, any object with host and port (and
        optionally auth_token, tls), or a mapping.
        """
        given = None if head_server_config is None else as_server_config(head_server_config)
        injected = _injected_config()
        if injected is not None:
            client = cls._from_global_config(given or _injected_head_server(injected), injected)
            client._asks_head = False
            return client
        head = given or cls.load_head_server_config()
        # Token and TLS from head_server (auth_token, tls) or the environment. With the head's token the client
        # is authenticated and gets the secrets (API keys) its server needs; without one they stay redacted.
        security = client_security(head)
        control = _control_client(_head_address(head), security=security)
        traced_already = TRACING.enabled  # the channel is traced from the start when the environment says so
        started_ns = time.time_ns()
        config = control.get_global_config(include_secrets=_asks_for_secrets(control))
        ended_ns = time.time_ns()
        client = cls._from_global_config(head, config)  # decides tracing with the config's observability_enabled
        if TRACING.enabled and not traced_already:
            from gym_rpc.client.tracing import record_config_fetch_span  # tracing on only

            record_config_fetch_span(control.address, started_ns, ended_ns)
        return client

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
        ADVERTISED_RETRY_SECONDS. A client made from an injected config never asks: loopback, cached.
        Blocking when the head is asked: from an event loop use `_aresolve_base_url`.
        """
        routed = self._routed_url(server_name, wait=True)
        return routed if routed is not None else self._resolve_with(server_name, self._advertised_base_urls)

    def rollout_target(
        self, server_name: str, rollout_id: str | None, token_capture: bool = False, trace_context: bool = True
    ) -> RolloutTarget:
        """The base URL and headers for a rollout's calls to `server_name` made by a client Gym does not instrument
        (an OpenAI client: `AsyncOpenAI(base_url=target.url + "/v1", default_headers=target.headers)`), by the
        entry's form. A Gym server: `apply_rollout_prefix(url, rollout_id, ...)` and no header. An engine or router
        (`session_affinity_header`): its URL as it is, the rollout id in its header and, while traces export, the
        trace context in `traceparent`; it has no training-token-capture path, so `token_capture` is a
        ValueError there. Blocking, as `_resolve_base_url`; trace_context=False as for apply_rollout_prefix."""
        url = self._resolve_base_url(server_name)
        entry = self._global_config.servers.get(server_name)
        header = None if entry is None else entry.session_affinity_header
        if header is None or _model_server_override(server_name) is not None:  # a launcher's URL is as given
            return RolloutTarget(apply_rollout_prefix(url, rollout_id, token_capture, trace_context), {})
        if token_capture:
            raise ValueError(
                f"server {server_name!r} takes a rollout in its {header} header (session_affinity_header): an "
                f"engine or router has no training-token-capture path"
            )
        return RolloutTarget(url, rollout_headers(rollout_id, header, trace_context))

    def _routed_url(self, server_name: str, *, wait: bool) -> str | None:
        """For a server with several instances, the current rollout's instance, else a healthy one; None for a
        server with one (its URL is resolved as it always was)."""
        routing = self._routing
        if routing is None:
            routing = self._routing_started(wait_seconds=FIRST_INSTANCES_WAIT_SECONDS if wait else 0.0)
        route = routing.routes.get(server_name)
        if route is None:
            return None
        return route.any_url(rollout_id_in_context() or nemo_gym_rollout_id() or None)

    async def _aresolve_base_url(self, server_name: str) -> str:
        """`_resolve_base_url` for the event loop: a call to the head runs in a thread, never in the loop (which
        may be serving that head). The loop only reads the answer: it never makes a control call itself, even
        when the next lookup falls due while the thread runs."""
        entry = self._global_config.servers.get(server_name)
        if (
            entry is not None
            and is_wildcard_host(entry.host)
            and self._asks_head
            and self._advertised_lookup_due()
        ):
            import asyncio  # a worker that only asks the head never loads asyncio

            await asyncio.to_thread(self._advertised_base_urls)
        routed = self._routed_url(server_name, wait=False)
        return routed if routed is not None else self._resolve_with(server_name, self._known_advertised_urls)

    def _resolve_with(self, server_name: str, advertised_urls: Callable[[], dict[str, str]]) -> str:
        url = self._server_base_urls.get(server_name)
        if url is not None:
            return url
        override = _model_server_override(server_name)
        if override is not None:
            return override  # never cached: read again per call (only in a harness the launcher set it for)
        servers = self._global_config.servers
        entry = servers.get(server_name)
        if entry is None:
            self._global_config.raise_unusable(server_name)
            raise UnknownServerError(server_name, list(servers))
        if not is_wildcard_host(entry.host) or not self._asks_head:
            url = self._server_base_urls[server_name] = entry.url
            return url
        advertised = advertised_urls().get(server_name)
        if advertised is None:
            return entry.url
        self._server_base_urls[server_name] = advertised
        return advertised

    def lookup_registered_servers(self) -> dict[str, str]:
        """Ask the head now where servers registered and dial wildcard-bound ones there: name -> advertised URL
        of each server registered at one address; a server of several instances is routed over all of them.

        The explicit lookup for a client made from an injected `NEMO_GYM_CONFIG_DICT`, which otherwise never asks
        the head; any client may call it to pick up registrations at once. Blocking (one bounded call, a head that
        cannot say adds nothing): from an event loop, run it with `asyncio.to_thread`.
        """
        found = self._fetch_advertised_urls()
        with _advertised_lock:
            self._advertised_urls = {**(self._advertised_urls or {}), **found}
            self._advertised_fetched_at = time.time()
        for name, entry in self._global_config.servers.items():
            if is_wildcard_host(entry.host) and name in found:
                self._server_base_urls[name] = found[name]
        return dict(found)

    def _known_advertised_urls(self) -> dict[str, str]:
        return self._advertised_urls or {}

    def _advertised_lookup_due(self) -> bool:
        return (
            self._advertised_urls is None or time.time() - self._advertised_fetched_at >= ADVERTISED_RETRY_SECONDS
        )

    def _advertised_base_urls(self) -> dict[str, str]:
        """name -> advertised URL of the servers registered with the head, fetched when a lookup is due (a head
        that cannot say adds nothing: wildcard-bound servers are dialled on loopback meanwhile)."""
        if self._advertised_lookup_due():
            with _advertised_lock:
                if self._advertised_lookup_due():
                    self._advertised_urls = {**(self._advertised_urls or {}), **self._fetch_advertised_urls()}
                    self._advertised_fetched_at = time.time()
        return self._advertised_urls or {}

    def _fetch_advertised_urls(self) -> dict[str, str]:
        """Every instance the head lists, into this client's routes (a server of several is routed over them
        from now on); name -> advertised URL of the servers registered at one address."""
        rows = self._fetch_instances()
        self._routing_started().apply_rows(rows)
        return _advertised_urls_of(rows)

    def _fetch_instances(self) -> list[ServerInstance]:
        """Every instance the head lists (ListServerInstances); none when the head cannot say."""
        address = _head_address(self.head_server_config)
        try:
            control = _control_client(
                address, timeout_seconds=ADVERTISED_LOOKUP_TIMEOUT_SECONDS, security=self._head_security()
            )
            return control.list_server_instances()
        except GymRpcError as exc:
            logger.warning(
                "cannot ask the head at %s where wildcard-bound servers registered (%s); dialling them on "
                "loopback",
                address,
                exc,
            )
            return []

    # --- replicas: routes to servers with several instances (docs/replicas.md) ---

    def require_labels(self, server_name: str, labels: Mapping[str, str] | None) -> None:
        """Send new rollouts and calls of no rollout for `server_name` only to its instances whose labels carry
        every `key=value` of `labels` (None: any instance again), e.g. `{"weights_version": "43"}` after a weight
        refit. Rollouts already pinned to an instance finish there. A call that no instance can take then fails
        with NoHealthyInstanceError naming each instance's labels. For this client, in every process it is
        pickled to."""
        if server_name not in self._global_config.servers:
            self._global_config.raise_unusable(server_name)
            raise UnknownServerError(server_name, list(self._global_config.servers))
        selector = None if labels is None else _checked_labels(labels)
        if selector is None:
            self._label_selectors.pop(server_name, None)
        else:
            self._label_selectors[server_name] = selector
        for routing in (self._routing, self._pending_routing and self._pending_routing[0]):
            if routing is not None:
                routing.set_selector(server_name, selector, self._global_config)

    def engine_loads(self, server_name: str) -> dict[str, EngineLoad]:
        """instance id -> the load the head last read from each engine instance of `server_name` (an entry with
        `session_affinity_header`) and pushed to this process: requests waiting and running, KV-cache use, and
        its age. An instance whose load is unknown (never read, or older than ENGINE_LOAD_MAX_AGE_SECONDS) is
        left out; a figure the engine does not report is None. Empty for other servers and for a client that does
        not follow the head. No I/O."""
        if server_name not in self._global_config.servers:
            self._global_config.raise_unusable(server_name)
            raise UnknownServerError(server_name, list(self._global_config.servers))
        return self._routing_started().engine_loads.server(server_name)

    def follow_instances(self, follow: bool = True) -> None:
        """Follow the head's instances (its status watch, in the background) from now on, or (False) stop. A
        client that asks the head follows by default; one made from an injected NEMO_GYM_CONFIG_DICT never asks
        the head by itself, and knows only the config's static replicas (and those `lookup_registered_servers()`
        found) until this is called."""
        self._follows_instances = follow
        pending = self._pending_routing
        if pending is None:
            return
        routing, follower = pending
        if follow and follower is None:
            follower = self._follower_of_the_head()
            follower.subscribe(routing)
        elif not follow and follower is not None:
            follower.unsubscribe(routing)
            follower = None
        self._pending_routing = (routing, follower)

    def _follower_of_the_head(self) -> InstanceFollower:
        """This process's follower of the head's instances; gRPC loads here, with the first call that needs it."""
        from gym_rpc.client._follower import follower_for

        return follower_for(_head_address(self.head_server_config), self._head_security())

    def _follows(self) -> bool:
        return self._asks_head if self._follows_instances is None else self._follows_instances

    def _routing_started(self, wait_seconds: float = 0.0) -> Routing:
        """This process's routes for the client, made (and its follower subscribed) on first use; waits up to
        `wait_seconds` (blocking) for the head's first list of instances."""
        with _routing_lock:
            pending = self._pending_routing
            if pending is None:
                config = self._global_config
                skipped = frozenset(name for name in config.servers if _model_server_override(name) is not None)
                from gym_rpc.client.replicas import Routing  # with aiohttp: the data plane's, on first use

                routing = Routing(config, self._http.settings.outlier_detection, self._label_selectors, skipped)
                follower = None
                if self._follows():
                    follower = self._follower_of_the_head()
                    follower.subscribe(routing)
                pending = self._pending_routing = (routing, follower)
        routing, follower = pending
        if follower is None or follower.first_snapshot.done():
            self._routing = routing
        elif wait_seconds > 0:
            import concurrent.futures

            concurrent.futures.wait([follower.first_snapshot], wait_seconds)
            self._routing = routing
        return routing

    async def _ready_routing(self) -> Routing:
        """`_routing_started` for the event loop: the wait for the head's first list of instances (at most
        FIRST_INSTANCES_WAIT_SECONDS, once) never blocks the loop."""
        routing = self._routing_started()
        pending = self._pending_routing
        follower = pending[1] if pending is not None else None
        if follower is not None and not follower.first_snapshot.done():
            import asyncio

            first = asyncio.wrap_future(follower.first_snapshot)
            await asyncio.wait([first], timeout=FIRST_INSTANCES_WAIT_SECONDS)
        self._routing = routing
        return routing

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
        return await self._call(
            method,
            server_name,
            url_path,
            _control=_control,
            _resend_after_disconnect=_resend_after_disconnect,
            **kwargs,
        )

    async def _call(
        self,
        method: str,
        server_name: str,
        url_path: str,
        *,
        _control: bool = False,
        _resend_after_disconnect: bool = True,
        **kwargs: Unpack[_RequestOptions],
    ) -> aiohttp.ClientResponse:
        """The hot path of `request`, `post` and `get`: a cached URL, the rollout prefix rule and the request.

        What a call keeps alive while it waits is what the collector pays for at thousands in flight (bench/
        allocations.py): after the first call `client.post(...)` and `client.get(...)` are this coroutine itself
        (`_bind_direct_calls`), and the first attempt is made here, with no coroutine of `send`'s: the resend path
        takes over only after a failure.
        """
        resend = _resend_after_disconnect
        plane = self._data_plane
        routing = plane.routing
        if routing is None:
            routing = plane.routing = await self._ready_routing()
        route = routing.routes.get(server_name)
        if route is None:
            url = plane.base_urls.get(server_name) or await self._aresolve_base_url(server_name)
        body = kwargs.pop("json", None)
        if body is not None:
            if type(body) is not dict and isinstance(body, BaseModel):  # BaseModel's isinstance is an ABC check
                body = body.model_dump(mode="json", exclude_unset=True)
            if kwargs.get("data") is not None:
                raise ValueError("data and json parameters can not be used at the same time")
            kwargs["data"] = plane.json_payload(body)
        config = plane.config
        if route is not None:
            keys = plane.sticky_keys(route, server_name, body, kwargs)
        if plane.path_rule is not None:  # decided once per client (gym_rpc.client.data._call_paths)
            url_path = plane.path_rule(config, server_name, url_path, body, kwargs)
        pools = plane.pools
        sessions = pools.sessions()
        session = sessions.control if _control else sessions.data
        retry = pools.settings.retry
        calls = sessions.calls  # the loop's calls in flight: the client-wide resend budget's measure of load
        calls.value += 1
        try:
            if route is not None:
                return await plane.send_routed(
                    route, keys, session, method, server_name, url_path, retry, resend, kwargs
                )
            full_url = url + url_path
            if METRICS.enabled:  # what metrics and tracing cost when off: these two checks
                return await plane.metered_send(session, method, url, full_url, retry, resend, kwargs, server_name)
            if TRACING.enabled:
                span = plane.call_span(session, method, url, full_url, kwargs, server_name)
                if span is not None:
                    return await plane.send(
                        session, method, full_url, retry, resend, kwargs, span, server_name=server_name
                    )
                # no span (a child of an unsampled parent, its context in the headers): sent as untraced calls are
            started = time.monotonic()  # the start of the call's deadline, as in `_http.send`
            try:
                response = await session.request(method, full_url, **kwargs)
            except BaseException as error:
                failure = error
            else:
                status = response.status
                if status < 429 or status not in BACKPRESSURE_STATUSES:  # most answers: one int comparison
                    return response
                failure = plane.backpressure(response)  # busy: asked again after its Retry-After, within budget
            return await plane.resend_after_failure(
                failure, session, method, full_url, retry, resend, kwargs, None, server_name, None, started
            )
        finally:
            calls.value -= 1

    async def get(
        self, server_name: str, url_path: str, **kwargs: Unpack[_RequestOptions]
    ) -> aiohttp.ClientResponse:
        # As in NeMo Gym, `get` and `post` go through a subclass's own `request`.
        if type(self).request is not ServerClient.request:
            return await self.request(server_name, url_path, "GET", **kwargs)
        return await self._call("GET", server_name, url_path, **kwargs)

    async def post(
        self, server_name: str, url_path: str, **kwargs: Unpack[_RequestOptions]
    ) -> aiohttp.ClientResponse:
        if type(self).request is not ServerClient.request:
            return await self.request(server_name, url_path, "POST", **kwargs)
        return await self._call("POST", server_name, url_path, **kwargs)

    get.__doc__ = post.__doc__ = _CALL_ARGS_DOC

    async def aclose(self) -> None:
        """Close the running loop's data and control sessions (shared with clients of the same settings)."""
        await self._http.close()

    def poll_for_status(self, server_name: str, timeout_seconds: float = 5) -> ServerStatus:
        """The server's status as the head probes it within `timeout_seconds`; the head's own name asks the head's
        health service. While the head is unreachable, the server is probed directly (as NeMo Gym always does),
        and the log says the head was skipped. A NeMo Gym HTTP head keeps no statuses: there every poll is one
        direct probe, as with NeMo Gym's own client. Blocking; safe with or without a loop."""
        deadline = time.monotonic() + timeout_seconds
        control = _control_client(
            _head_address(self.head_server_config),
            timeout_seconds=timeout_seconds,
            security=self._head_security(),
        )
        if server_name == HEAD_SERVER_KEY:
            return control.head_status()
        if not control.head().keeps_statuses:  # NeMo Gym's HTTP head: a poll is one direct probe
            return self._probe_directly(server_name, deadline)
        try:
            report = control.get_server_status(server_name)
        except HeadTimeoutError:  # the head is there but answered too late: as NeMo Gym's client says then
            return "timeout"
        except HeadUnreachableError as exc:
            logger.warning(
                "status of %s: the head at %s is unreachable (%s); skipped it and probed the server directly",
                server_name,
                exc.address,
                exc.code,
            )
            return self._probe_directly(server_name, deadline)
        except ControlPlaneError as exc:
            logger.warning("status of %s: %s", server_name, exc)
            return "unknown_error"
        return report.status or "unknown_error"

    def _probe_directly(self, server_name: str, deadline: float) -> ServerStatus:
        """GET the server's base URL: any HTTP answer is "success", refused "connection_error", none in time
        "timeout", anything else "unknown_error" (NeMo Gym's rule)."""
        entry = self._global_config.server(server_name)  # unknown: UnknownServerError, a KeyError
        url = self._server_base_urls.get(server_name) or entry.url
        from gym_rpc.client.nemo_gym import probe  # http.client (and ssl) load with the first direct probe

        return probe(url, max(deadline - time.monotonic(), _MIN_DIRECT_PROBE_SECONDS)).status

    def _config_if_changed(self) -> GlobalConfig | None:
        """The head's config when its version differs from this client's; None (nothing sent) when unchanged."""
        control = _control_client(_head_address(self.head_server_config), security=self._head_security())
        return control.get_global_config_if_changed(
            self._global_config.version, include_secrets=_asks_for_secrets(control)
        )

    def _head_security(self) -> ClientSecurity:
        if self._security is None:
            self._security = client_security(self.head_server_config)
        return self._security

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
ServerClient.global_config_dict = _LazyDictConfigField()  # type: ignore[assignment]


def _head_address(head_server_config: BaseServerConfig) -> str:
    """Where the client reaches the head: host and port, or every head the block's `addresses` lists, as
    `a:11000,b:11000` (the control clients fail over among them)."""
    addresses = (head_server_config.model_extra or {}).get("addresses")
    if addresses:
        return ",".join(parse_head_addresses(addresses, f"{HEAD_SERVER_KEY}.addresses"))
    return f"{url_host(connectable_host(head_server_config.host))}:{head_server_config.port}"


def _control_client(
    address: str, *, security: ClientSecurity, timeout_seconds: float | None = None
) -> SyncControlClient:
    """A control client to the head, gRPC imported on first use: a worker whose config was injected
    (`NEMO_GYM_CONFIG_DICT`) and never asks the head never loads it, nor pays for it at import."""
    from gym_rpc.client.control import SyncControlClient

    if timeout_seconds is None:
        return SyncControlClient(address, security=security)
    return SyncControlClient(address, timeout_seconds=timeout_seconds, security=security)


def _asks_for_secrets(control: SyncControlClient) -> bool:
    """A worker needs its servers' API keys: a gym_rpc head gives them to a caller with its token; NeMo Gym's HTTP
    head gives everyone the whole config, as NeMo Gym's own client gets it."""
    return control.security.token is not None or not control.head().guards_secrets


def _advertised_urls_of(instances: list[ServerInstance]) -> dict[str, str]:
    """name -> advertised URL of each server that registered one instance (a server of several has a route)."""
    urls: dict[str, list[str]] = {}
    for instance in instances:
        if instance.advertised_url:
            urls.setdefault(instance.name, []).append(instance.advertised_url)
    return {name: found[0] for name, found in urls.items() if len(found) == 1}


def _checked_labels(labels: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(labels, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) and key for key, value in labels.items()
    ):
        raise ValueError(
            f"labels must map non-empty strings to strings, e.g. {{'weights_version': '43'}}; got {labels!r}"
        )
    return dict(labels)


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
