"""NeMo Gym's HTTP head, from a client: its config, its instances, and status probed directly, as NeMo Gym does.

What a process that `ng_run` launched finds at `head_server` (gym_rpc.client.nemo_gym._head_protocol tells it apart
from a gym_rpc head). The endpoints, as NeMo Gym's FastAPI head serves them: `GET /global_config_dict_yaml` answers
the config's YAML text as a JSON string, `GET /server_instances` a JSON list of the processes it launched, `GET /`
`{"status": "ok"}`. It has no status of its own to ask: a server's status is a `GET` of its base URL, any HTTP
answer counting as up (NeMo Gym's `poll_for_status`). Blocking calls on the standard library's http.client, one
connection per request, each ended by its timeout however the head answers and read up to a size bound
(gym_rpc.client.nemo_gym._bounded_get).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
from collections.abc import Mapping
from typing import Any

import grpc

from gym_rpc.client.nemo_gym._bounded_get import bounded_get
from gym_rpc.client.nemo_gym._head_protocol import GRPC, protocol_of_answer
from gym_rpc.client.nemo_gym._probe import probe
from gym_rpc.config import GlobalConfig, parse_config_text, parse_host_port, redact_secrets
from gym_rpc.errors import ControlPlaneError, HeadTimeoutError, HeadUnreachableError
from gym_rpc.wire import SERVER_STATUSES, ServerInstance, ServerStatus

CONFIG_PATH = "/global_config_dict_yaml"
INSTANCES_PATH = "/server_instances"
_MAX_ANSWER_BYTES = 64 * 1024 * 1024  # as the gRPC client's largest accepted answer
_SHOWN_ANSWER_BYTES = 40  # of an answer that is no HTTP/1.x, in its error


class NemoGymEndpoints:
    """The HTTP endpoints of NeMo Gym's head at `address` (HOST:PORT); what a failure says of the head (gone,
    silent) is the head seam's to act on (gym_rpc.client.control._heads)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.url = f"http://{address}"

    def config(self, timeout: float, *, include_secrets: bool) -> GlobalConfig:
        """The global config; secret-looking values redacted unless asked for, as a gym_rpc head serves them (the
        version is the whole document's either way, so a redacted copy is current as long as the original)."""
        payload = self._get_json(CONFIG_PATH, timeout)
        if not isinstance(payload, str):
            raise self._bad_answer(CONFIG_PATH, f"a JSON {type(payload).__name__}, not the config's YAML text")
        config = GlobalConfig.from_document(parse_config_text(payload, self.url + CONFIG_PATH), lenient=True)
        if include_secrets:
            return config
        redacted = GlobalConfig.from_document(redact_secrets(config.document), lenient=True)
        return dataclasses.replace(redacted, version=config.version)

    def instances(self, timeout: float) -> list[ServerInstance]:
        """What `/server_instances` lists: one row per process NeMo Gym launched."""
        payload = self._get_json(INSTANCES_PATH, timeout)
        if not isinstance(payload, list):
            raise self._bad_answer(INSTANCES_PATH, f"a JSON {type(payload).__name__}, not a list")
        return [_instance(item) for item in payload if isinstance(item, Mapping)]

    def status(self, timeout: float) -> ServerStatus:
        """The head's own status: a GET of `/`, as NeMo Gym's poll_for_status asks its head."""
        return probe(self.url + "/", timeout).status

    def _get_json(self, path: str, timeout: float) -> Any:
        host, port = parse_host_port(self.address, "head address")
        try:
            answer = bounded_get(
                host, port, path, timeout=timeout, max_body=_MAX_ANSWER_BYTES, accept="application/json"
            )
        except (OSError, http.client.HTTPException) as exc:
            raise self._unanswered(path, timeout, exc) from exc
        if answer.status != 200:
            raise self._bad_answer(path, f"HTTP {answer.status}")
        if not answer.whole:
            raise self._bad_answer(path, f"more than {_MAX_ANSWER_BYTES} bytes")
        try:
            return json.loads(answer.body)
        except ValueError as exc:
            raise self._bad_answer(path, f"no JSON ({exc})") from exc

    def _unanswered(
        self, path: str, timeout: float, error: OSError | http.client.HTTPException
    ) -> ControlPlaneError:
        """No answer in time (the head may be there but slow), or none at all (it is not there, or is no HTTP/1.x
        server)."""
        if isinstance(error, TimeoutError):
            return HeadTimeoutError(
                f"NeMo Gym's head at {self.url} did not answer GET {path} (all of it) within {timeout:g} s; check "
                "that it runs and is not overloaded",
                address=self.address,
                code=grpc.StatusCode.DEADLINE_EXCEEDED,
            )
        return HeadUnreachableError(
            f"NeMo Gym's head at {self.url} is unreachable ({_failure_text(error)}); check that `ng_run` runs it "
            "there and that the address (head_server, --head or GYM_RPC_HEAD) is right",
            address=self.address,
            code=grpc.StatusCode.UNAVAILABLE,
        )

    def _bad_answer(self, path: str, what: str) -> ControlPlaneError:
        return ControlPlaneError(
            f"NeMo Gym's head at {self.url} answered GET {path} with {what}",
            address=self.address,
            code=grpc.StatusCode.UNKNOWN,
        )


def _instance(item: Mapping[str, Any]) -> ServerInstance:
    """One `/server_instances` row as a ServerInstance (NeMo Gym's `process_name` is the server's name)."""

    def text(key: str) -> str:
        value = item.get(key)
        return value if isinstance(value, str) else ""

    def number(key: str) -> float:
        value = item.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

    status = item.get("status")
    return ServerInstance(
        name=text("process_name") or text("config_path"),
        server_type=text("server_type"),
        impl_name=text("name"),
        url=text("url"),
        pid=int(number("pid")),
        start_time=number("start_time"),
        status=status if status in SERVER_STATUSES else None,
    )


def _failure_text(error: OSError | http.client.HTTPException) -> str:
    """What went wrong, readable: an answer that is no HTTP/1.x (http.client's BadStatusLine holds its raw bytes)
    is named by its protocol, or shown as the escaped start of it."""
    if not isinstance(error, http.client.BadStatusLine):
        return str(error) or type(error).__name__
    first = str(error).encode("latin-1", "replace")  # its one argument: the line as read, decoded as latin-1
    if protocol_of_answer(first) == GRPC:
        return "it answered in HTTP/2, as a gRPC server does: a gym_rpc head may have started there"
    return f"its answer is no HTTP/1.x: {first[:_SHOWN_ANSWER_BYTES]!r}"
