"""What a failed data-plane call does: the kind of its failure, the budgets by kind, in time and client-wide, the
call as it goes out and is resent, the resend itself, and one log line per server per interval.

Imports nothing else of the client. Exports import on first use."""

from typing import TYPE_CHECKING

from gym_rpc._lazy import lazy_modules

if TYPE_CHECKING:
    from gym_rpc.client.resend._budget import CallCount as CallCount
    from gym_rpc.client.resend._budget import ConcurrencyCap as ConcurrencyCap
    from gym_rpc.client.resend._budget import new_call_count as new_call_count
    from gym_rpc.client.resend._failures import Backpressure as Backpressure
    from gym_rpc.client.resend._fresh import register_fresh_twin as register_fresh_twin
    from gym_rpc.client.resend._policy import BACKPRESSURE_STATUSES as BACKPRESSURE_STATUSES
    from gym_rpc.client.resend._policy import ClientBudget as ClientBudget
    from gym_rpc.client.resend._policy import FailureKind as FailureKind
    from gym_rpc.client.resend._policy import KindBudget as KindBudget
    from gym_rpc.client.resend._policy import RetryPolicy as RetryPolicy
    from gym_rpc.client.resend._resend import CallObserver as CallObserver
    from gym_rpc.client.resend._resend import Reroute as Reroute
    from gym_rpc.client.resend._resend import ResentCall as ResentCall
    from gym_rpc.client.resend._resend import resend_after_failure as resend_after_failure
    from gym_rpc.client.resend._resend import with_total as with_total

__getattr__ = lazy_modules(
    __name__,
    {
        "_budget": "CallCount ConcurrencyCap new_call_count",
        "_failures": "Backpressure",
        "_fresh": "register_fresh_twin",
        "_policy": "BACKPRESSURE_STATUSES ClientBudget FailureKind KindBudget RetryPolicy",
        "_resend": "CallObserver Reroute ResentCall resend_after_failure with_total",
    },
)
