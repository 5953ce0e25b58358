"""The codes `gym-rpc` exits with, and which code a failure means.

`gym-rpc --help` lists them for users (the parser's description) and docs/cli.md explains each: an orchestrator
acts on them. UsageError is the failure that exits 2 once the command line has parsed (a name that does not exist,
an empty token file).
"""

from __future__ import annotations

from gym_rpc.errors import ControlPlaneError, GymRpcError, HeadUnreachableError

EXIT_OK = 0
EXIT_DOWN = 1  # also: the command failed
EXIT_USAGE = 2  # argparse's own code for bad usage
EXIT_HEAD_UNREACHABLE = 3
EXIT_CREDENTIALS_REFUSED = 4  # the head refused the token, or the TLS handshake failed
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell shows for a command whose reader went away


class UsageError(GymRpcError):
    """A command line that names something that does not exist (exit 2)."""


# What gRPC's own message (the details of the UNAVAILABLE it ends in, as for a head that is down) says when the TLS
# handshake failed: "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...CERTIFICATE_VERIFY_FAILED".
_TLS_FAILURE_MARKS = ("handshake failed", "ssl_error", "certificate_verify_failed")


def exit_code_of(error: ControlPlaneError) -> int:
    """Refused credentials (a wrong or missing token, a TLS handshake that failed), an unreachable head, or else
    a failed command."""
    if error.code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return EXIT_CREDENTIALS_REFUSED
    if isinstance(error, HeadUnreachableError):
        details = getattr(error.__cause__, "details", None)
        said = (details() if callable(details) else "") or ""
        if error.code.name == "UNAVAILABLE" and any(mark in said.lower() for mark in _TLS_FAILURE_MARKS):
            return EXIT_CREDENTIALS_REFUSED
        return EXIT_HEAD_UNREACHABLE
    return EXIT_DOWN
