"""How errors travel: a failed gRPC call becomes one typed gym_rpc error (the idea of python-api-core's
`from_grpc_error`), and an unknown server name travels as a standard `google.rpc.Status` with an `ErrorInfo`
detail (grpcio-status), so any gRPC client (grpcurl, the TypeScript and Go stubs) can read the known names too.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gym_rpc.errors import (
    MAX_QUOTED_CHARACTERS,
    ControlPlaneError,
    GymRpcError,
    HeadTimeoutError,
    HeadUnreachableError,
    UnknownServerError,
    first_names,
)
from gym_rpc.wire._names import HEAD_ADDRESS_ENV_VAR, TLS_CA_ENV_VAR

ERROR_DOMAIN = "gym-rpc"
UNKNOWN_SERVER_REASON = "UNKNOWN_SERVER"
SERVER_NAME_KEY = "server_name"
KNOWN_SERVERS_KEY = (
    "known_servers"  # comma-separated: server names cannot hold a comma (they are YAML keys of ours)
)


def unknown_server_status(server_name: str, known: list[str]) -> grpc.Status:
    """The NOT_FOUND the head answers for a name it does not know, with the known names as ErrorInfo metadata.

    The caller's name is echoed cut to MAX_QUOTED_CHARACTERS, and only the known names that fit in
    MAX_LISTED_CHARACTERS are sent: the answer stays a few KiB (inside every client's 16 KiB metadata limit)
    whatever the caller sent or the config holds."""
    info = error_details_pb2.ErrorInfo(
        reason=UNKNOWN_SERVER_REASON,
        domain=ERROR_DOMAIN,
        metadata={
            SERVER_NAME_KEY: server_name[:MAX_QUOTED_CHARACTERS],
            KNOWN_SERVERS_KEY: ",".join(first_names(known)),
        },
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    message = str(UnknownServerError(server_name, known))  # bounded the same way
    status = status_pb2.Status(code=grpc.StatusCode.NOT_FOUND.value[0], message=message, details=[detail])
    return rpc_status.to_status(status)


def _unknown_server(error: grpc.Call | grpc.aio.AioRpcError) -> UnknownServerError | None:
    """The unknown name and the known ones from the answer's ErrorInfo; None when it carries none."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]  # AioRpcError has the same accessors
    except ValueError:  # details that contradict the status line: not ours
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.domain == ERROR_DOMAIN and info.reason == UNKNOWN_SERVER_REASON:
            known = [name for name in info.metadata[KNOWN_SERVERS_KEY].split(",") if name]
            return UnknownServerError(info.metadata[SERVER_NAME_KEY], known)
    return None


def status_code(error: grpc.RpcError) -> grpc.StatusCode:
    # grpc.aio's AioRpcError is no grpc.Call, yet carries the same code, details and trailing metadata.
    return error.code() if isinstance(error, grpc.Call | grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN


def from_grpc_error(error: grpc.RpcError, address: str) -> GymRpcError:
    """The typed error for a failed control call to the head at `address`. The caller raises it `from error`,
    so the gRPC error stays its cause."""
    code = status_code(error)
    details = (error.details() if isinstance(error, grpc.Call | grpc.aio.AioRpcError) else None) or str(error)
    if code == grpc.StatusCode.UNAVAILABLE:
        return HeadUnreachableError(
            f"head server at {address} is unreachable ({details}); check that `gym-rpc head` runs there, that "
            f"the address (--head or {HEAD_ADDRESS_ENV_VAR}) is right, and, with TLS, that the CA "
            f"({TLS_CA_ENV_VAR}) signed the head's certificate",
            address=address,
            code=code,
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return HeadTimeoutError(
            f"head server at {address} did not answer in time; check that it runs and is not overloaded",
            address=address,
            code=code,
        )
    if code == grpc.StatusCode.NOT_FOUND and isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        unknown = _unknown_server(error)
        if unknown is not None:
            return unknown
    head = f"head server at {address}" + (" refused the call" if code == grpc.StatusCode.UNAUTHENTICATED else "")
    return ControlPlaneError(f"{head}: {code.name}: {details}", address=address, code=code)
