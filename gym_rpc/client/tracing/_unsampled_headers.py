"""The trace-context headers of calls whose parent span is unsampled, made once per OpenTelemetry context.

Under a sampler that drops most rollouts, most calls make no span: each only carries its unsampled parent's context
on, in one `traceparent` header. A rollout's calls all run in the rollout's context, which never changes (a change
makes a new context), so with the same global propagator their headers are the same: made on the first call and
shared by the rest, read-only (aiohttp copies the headers it is given). `rollout_context` forgets its context's
entry when the rollout ends, so an entry lives no longer than its rollout: kept longer, entries would reach the
collector's oldest generation and bring on full collections, which a worker's live heap makes long. Entries of
other contexts (the application's own unsampled spans) are all forgotten at once when MAX_CONTEXTS are kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multidict import CIMultiDictProxy
    from opentelemetry.context import Context
    from opentelemetry.propagators.textmap import TextMapPropagator

MAX_CONTEXTS = 16384
# id(context) -> (context, the global propagator that wrote the headers, the headers); the context kept in the
# entry is what makes its id safe to key by (an id is reused only once its object is gone).
_by_context: dict[int, tuple[Context, TextMapPropagator, CIMultiDictProxy[str]]] = {}


def known_headers(context: Context, propagator: TextMapPropagator) -> CIMultiDictProxy[str] | None:
    """The headers remembered for `context` by `propagator`; None if there are none."""
    known = _by_context.get(id(context))
    if known is None or known[0] is not context or known[1] is not propagator:
        return None
    return known[2]


def remember_headers(
    context: Context, propagator: TextMapPropagator, headers: CIMultiDictProxy[str]
) -> CIMultiDictProxy[str]:
    """Keep `headers` for the next calls in `context` (known_headers), and return them."""
    if len(_by_context) >= MAX_CONTEXTS:
        _by_context.clear()
    _by_context[id(context)] = (context, propagator, headers)
    return headers


def forget_headers(context: Context) -> None:
    """`context` is no longer current anywhere (its rollout ended). Safe beside another thread's calls, which may
    clear the entries meanwhile."""
    known = _by_context.get(id(context))
    if known is not None and known[0] is context:
        _by_context.pop(id(context), None)
