"""What a failed data-plane call does: the kind of its failure, the budgets by kind, in time and client-wide, the
resend itself, and one log line per server per interval.

Imports nothing else of the client. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_exports

if TYPE_CHECKING:
    from gym_rpc.client.resend._budget import CallCount, ConcurrencyCap, new_call_count
    from gym_rpc.client.resend._failures import Backpressure
    from gym_rpc.client.resend._policy import (
        BACKPRESSURE_STATUSES,
        ClientBudget,
        FailureKind,
        KindBudget,
        RetryPolicy,
    )
    from gym_rpc.client.resend._resend import CallObserver, Reroute, resend_after_failure, with_total

_EXPORTS = {
    "Backpressure": "gym_rpc.client.resend._failures",
    "BACKPRESSURE_STATUSES": "gym_rpc.client.resend._policy",
    "CallCount": "gym_rpc.client.resend._budget",
    "CallObserver": "gym_rpc.client.resend._resend",
    "ClientBudget": "gym_rpc.client.resend._policy",
    "ConcurrencyCap": "gym_rpc.client.resend._budget",
    "FailureKind": "gym_rpc.client.resend._policy",
    "KindBudget": "gym_rpc.client.resend._policy",
    "new_call_count": "gym_rpc.client.resend._budget",
    "Reroute": "gym_rpc.client.resend._resend",
    "resend_after_failure": "gym_rpc.client.resend._resend",
    "RetryPolicy": "gym_rpc.client.resend._policy",
    "with_total": "gym_rpc.client.resend._resend",
}
__all__ = [
    "BACKPRESSURE_STATUSES",
    "Backpressure",
    "CallCount",
    "CallObserver",
    "ClientBudget",
    "ConcurrencyCap",
    "FailureKind",
    "KindBudget",
    "Reroute",
    "RetryPolicy",
    "new_call_count",
    "resend_after_failure",
    "with_total",
]
__getattr__ = lazy_exports(__name__, _EXPORTS)
