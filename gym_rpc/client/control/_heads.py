"""One seam per head protocol: the gRPC head, or NeMo Gym's HTTP head (an `ng_run` deployment).

`head_for(address, security)` finds out which one listens at an address (gym_rpc.client.nemo_gym._head_protocol:
one look per process and address) and returns its implementation, `GrpcHead` or `NemoGymHttpHead`, behind one
interface, `Head`: a row's unary call, blocking or awaited, and its stream, each backend making them its own way
(as temporalio's ServiceClient has one `_rpc_call` per backend). Callers ask a head what it can do
(`keeps_statuses`, `guards_secrets`, `pushes_instances`), never which protocol it speaks.

The seam also owns forgetting and looking again, once for both call paths. A failure that says the head went away
(UNAVAILABLE, or no answer within the deadline before anything came) forgets what the address spoke. A unary call
made to an address remembered as one protocol's, which fails as if nothing listened there, may have reached a head
of the other protocol started there since: `ng_run` on the port a `gym-rpc head` had, or the other way round
(11000 is both one's default). The address is looked at again within the call's deadline, and only when the look
finds the other protocol is the call made once more, with that head. The first attempt cannot have been served
then (a head of one protocol serves no request of the other), so no call is made twice. That decision is written
once (`_unary_steps`); the blocking and the asyncio client only run its steps (`BlockingTransport`,
`AsyncTransport`).

Several heads of one deployment (`a:11000,b:11000`, docs/multi-host.md "Several heads"): a client holds one client
of its flavour per head and the process follows one head; a unary call that finds it unreachable is made at the
next within its deadline (`_failover_steps`), and streams go to the head followed (`StatusWatch` moves on). With
one head none of this runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any, ClassVar, Generic, NamedTuple, Self, TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from gym_rpc.client.control._channel import (
    DEFAULT_TIMEOUT_SECONDS,
    aio_channel,
    checked_head_address,
    default_head_address,
    split_head_addresses,
    sync_channel,
)
from gym_rpc.client.control._credentials import ClientSecurity, client_security
from gym_rpc.client.control._rpc import AsyncCallPath, BlockingCallPath, Call, Rpc, StreamRpc
from gym_rpc.client.nemo_gym import (
    DETECT_TIMEOUT_SECONDS,
    GRPC,
    NEMO_GYM_HTTP,
    HeadProtocol,
    NemoGymEndpoints,
    forget_head_protocol,
    head_protocol,
    known_head_protocol,
    remembered_head_protocol,
    unimplemented,
)
from gym_rpc.errors import ControlPlaneError, HeadTimeoutError, HeadUnreachableError
from gym_rpc.v1 import control_plane_pb2_grpc as pb_grpc
from gym_rpc.wire import HEALTH_SERVICE_NAME, SERVICE_NAME, status_code

Result = TypeVar("Result")
Step = TypeVar("Step")
AnyRpc = Rpc[..., Any, Any, Result]

logger = logging.getLogger("gym_rpc.client.heads")

# Of several heads of one deployment (the address list, as given), the one this process follows: every client of
# the list shares it, so after a failover every call goes straight to the head that answered, and the status
# watch's followers reconnect there. It changes only when the head followed stops answering (no flapping back).
_followed_heads: dict[tuple[str, ...], str] = {}


class Head(ABC):
    """The head at one address, in the protocol it speaks: how a row's call is made there, and what it offers."""

    protocol: ClassVar[HeadProtocol]
    keeps_statuses: ClassVar[bool]  # False: a server's status is a direct probe of it (NeMo Gym's rule)
    guards_secrets: ClassVar[bool]  # False: everyone gets the whole config, as NeMo Gym's own client does
    pushes_instances: ClassVar[bool]  # False: no watch of registered instances to follow

    def __init__(self, address: str, security: ClientSecurity) -> None:
        self.address = address
        self.security = security

    @abstractmethod
    def unary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        """The call made here; its failure raised as it came (gRPC's) or typed (NeMo Gym's), for the seam."""

    @abstractmethod
    async def aunary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        """`unary` for the event loop."""

    @abstractmethod
    def stream(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Generator[Result, None, None]:
        """The stream's results, until the caller stops or it fails (typed)."""

    @abstractmethod
    def astream(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> AsyncGenerator[Result, None]:
        """`stream` for the event loop."""

    def failed(self, rpc: AnyRpc[Result], error: BaseException) -> Result:
        """A unary call's failure, as the caller gets it: typed (or the row's `on_error` result)."""
        raise error

    def forget_if_gone(self, code: grpc.StatusCode, answered: bool = False) -> None:
        """Whatever listens at the address next is looked at afresh when this failure says the head went away
        (a stream that answered and then reached its own deadline says nothing against it)."""
        if code == grpc.StatusCode.UNAVAILABLE or (code == grpc.StatusCode.DEADLINE_EXCEEDED and not answered):
            forget_head_protocol(self.address)


_STUB_CLASSES: dict[str, Callable[[Any], object]] = {
    SERVICE_NAME: pb_grpc.ControlPlaneServiceStub,
    HEALTH_SERVICE_NAME: health_pb2_grpc.HealthStub,
}
# A channel's stubs, made once per channel (a channel lives as long as its process, or its event loop).
_stubs: weakref.WeakKeyDictionary[object, dict[str, object]] = weakref.WeakKeyDictionary()


def _method(channel: grpc.Channel | grpc.aio.Channel, rpc: AnyRpc[Any]) -> Any:
    stubs = _stubs.get(channel)
    if stubs is None:
        stubs = _stubs[channel] = {service: make(channel) for service, make in _STUB_CLASSES.items()}
    return getattr(stubs[rpc.service], rpc.method)


class GrpcHead(Head):
    """A gym_rpc head: every row over the process's shared channel (one per event loop for grpc.aio), with the
    token as call metadata."""

    protocol = GRPC
    keeps_statuses = guards_secrets = pushes_instances = True

    def __init__(self, address: str, security: ClientSecurity) -> None:
        super().__init__(address, security)
        self._metadata = security.metadata()

    def unary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        method = _method(sync_channel(self.address, self.security.tls), rpc)
        timeout = rpc.deadline_for(call, client_timeout)
        return rpc.convert(method(call.request, timeout=timeout, metadata=self._metadata))

    async def aunary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        method = _method(aio_channel(self.address, self.security.tls), rpc)
        timeout = rpc.deadline_for(call, client_timeout)
        return rpc.convert(await method(call.request, timeout=timeout, metadata=self._metadata))

    def failed(self, rpc: AnyRpc[Result], error: BaseException) -> Result:
        if not isinstance(error, grpc.RpcError):
            raise error
        self.forget_if_gone(status_code(error))
        return rpc.failed(error, self.address)

    def stream(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Generator[Result, None, None]:
        with self._stream(sync_channel(self.address, self.security.tls), rpc, call, client_timeout) as stream:
            for message in stream.messages:
                stream.answered = True
                yield rpc.convert(message)

    async def astream(
        self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float
    ) -> AsyncGenerator[Result, None]:
        with self._stream(aio_channel(self.address, self.security.tls), rpc, call, client_timeout) as stream:
            async for message in stream.messages:
                stream.answered = True
                yield rpc.convert(message)

    def _stream(
        self, channel: grpc.Channel | grpc.aio.Channel, rpc: AnyRpc[Any], call: Call[Any], client_timeout: float
    ) -> _GrpcStream:
        deadline = rpc.deadline_for(call, client_timeout)
        messages = _method(channel, rpc)(call.request, timeout=deadline, metadata=self._metadata)
        return _GrpcStream(self, rpc, messages, deadline)


class _GrpcStream:
    """One gRPC stream's messages; at its end it is cancelled, and its failure raised typed (the head forgotten
    when the failure says it went away)."""

    def __init__(self, head: GrpcHead, rpc: AnyRpc[Any], messages: Any, deadline: float | None) -> None:
        self.head, self.rpc, self.messages, self.deadline = head, rpc, messages, deadline
        self.answered = False

    def __enter__(self) -> _GrpcStream:
        return self

    def __exit__(self, kind: object, error: BaseException | None, traceback: object) -> bool:
        try:
            if not isinstance(error, grpc.RpcError):
                return False
            self.head.forget_if_gone(status_code(error), self.answered)
            assert isinstance(self.rpc, StreamRpc)  # the stream call paths serve only StreamRpc rows
            # the DEADLINE_EXCEEDED of a stream that had answered is its own deadline passing
            self.rpc.stream_failed(error, self.head.address, self.deadline if self.answered else None)
            return True
        finally:
            self.messages.cancel()


class NemoGymHttpHead(Head):
    """NeMo Gym's HTTP head: each row's `http` function over its endpoints (rows without one are refused with
    UNIMPLEMENTED); blocking HTTP, in a thread from the event loop."""

    protocol = NEMO_GYM_HTTP
    keeps_statuses = guards_secrets = pushes_instances = False

    def __init__(self, address: str, security: ClientSecurity) -> None:
        super().__init__(address, security)
        self.endpoints = NemoGymEndpoints(address)

    def _answer(self, rpc: AnyRpc[Any], call: Call[Any], client_timeout: float) -> Any:
        """The row's answer from the endpoints: its result (for a stream, an iterator of them)."""
        if rpc.http is None:
            raise unimplemented(rpc.method, self.address)
        return rpc.http(self.endpoints, call.request, rpc.deadline_for(call, client_timeout))

    def unary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        try:
            result: Result = self._answer(rpc, call, client_timeout)
        except ControlPlaneError as error:
            self.forget_if_gone(error.code)
            raise
        return result

    async def aunary(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Result:
        return await asyncio.to_thread(self.unary, rpc, call, client_timeout)

    def stream(self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float) -> Generator[Result, None, None]:
        answered = False
        with contextlib.closing(self._answer(rpc, call, client_timeout)) as results:  # closed with this one
            try:
                for result in results:
                    answered = True
                    yield result
            except ControlPlaneError as error:
                self.forget_if_gone(error.code, answered)
                raise

    async def astream(
        self, rpc: AnyRpc[Result], call: Call[Any], client_timeout: float
    ) -> AsyncGenerator[Result, None]:
        async for result in _in_threads(self.stream(rpc, call, client_timeout)):
            yield result


async def _in_threads(results: Generator[Result, None, None]) -> AsyncGenerator[Result, None]:
    """A blocking generator (NeMo Gym's polled watch) iterated from the event loop, each step in a thread."""
    done = object()
    try:
        while (result := await asyncio.to_thread(next, results, done)) is not done:
            yield result  # type: ignore[misc]
    finally:
        with contextlib.suppress(ValueError):  # still running in its thread (the caller was cancelled)
            results.close()


_HEADS: dict[HeadProtocol, type[Head]] = {GRPC: GrpcHead, NEMO_GYM_HTTP: NemoGymHttpHead}


@functools.lru_cache(maxsize=256)
def _head(protocol: HeadProtocol, address: str, security: ClientSecurity) -> Head:
    return _HEADS[protocol](address, security)


def head_for(address: str, security: ClientSecurity, timeout: float = DETECT_TIMEOUT_SECONDS) -> Head:
    """The head at `address`: found out on this process's first call there (one look, within `timeout`), then
    remembered until a failure says it went away. A head that cannot be reached is taken for a gRPC head."""
    return _head(head_protocol(address, tls=security.tls is not None, timeout=timeout), address, security)


# --- one call path per flavour, over the seam ---


class _Step(NamedTuple):
    """What `_unary_steps` asks its runner for: the call made at `head`, or (None) a look at the address."""

    head: Head | None
    call: Call[Any]


def _unary_steps(transport: _Transport, rpc: AnyRpc[Result], call: Call[Any]) -> Generator[_Step, Any, Result]:
    """A unary call, with the look at the address and the one call made again after a second look (above); the
    runner sends back each step's outcome (a look's: the head and the call) or throws its failure in. An address
    this process knows needs no look."""
    address, client_timeout = transport.address, transport.timeout_seconds
    remembered, started = remembered_head_protocol(address), time.monotonic()
    head: Head
    other: Head
    result: Result
    known = known_head_protocol(address, tls=transport.security.tls is not None)
    if known is None:
        head, call = yield _Step(None, call)
    else:
        head = transport.head_of(known)
    try:
        result = yield _Step(head, call)
        return result
    except (grpc.RpcError, HeadUnreachableError) as error:
        if not _protocol_may_have_changed(error, remembered):
            return head.failed(rpc, error)
        forget_head_protocol(address)
        other, again = yield _Step(None, _rest_of(rpc, call, client_timeout, started))
        found = remembered_head_protocol(address)
        if found is None or found == remembered:  # nothing, or the same: the first failure stands
            return head.failed(rpc, error)
    try:
        result = yield _Step(other, again)
        return result
    except grpc.RpcError as error:
        return other.failed(rpc, error)


def _protocol_may_have_changed(error: BaseException, remembered: HeadProtocol | None) -> bool:
    """A failure as if nothing listened, at an address remembered as one protocol's."""
    if isinstance(error, grpc.RpcError):
        return remembered == GRPC and status_code(error) == grpc.StatusCode.UNAVAILABLE
    return remembered == NEMO_GYM_HTTP and not isinstance(error, HeadTimeoutError)


def _rest_of(rpc: AnyRpc[Any], call: Call[Any], client_timeout: float, started: float) -> Call[Any]:
    """`call` with what is left of its deadline (`started` when it began)."""
    deadline = rpc.deadline_for(call, client_timeout)
    if deadline is None:
        return call
    return Call(call.request, max(deadline - (time.monotonic() - started), 0.001))


class _Run(Generic[Step, Result]):
    """Steps (`_unary_steps`, `_failover_steps`) run to their end by a driver that makes each step, blocking or
    awaited."""

    def __init__(self, steps: Generator[Step, Any, Result]) -> None:
        self._steps = steps
        self._outcome: tuple[bool, Any] = (True, None)  # (made, what it returned) or (False, what it raised)
        self.result: Result

    def next_step(self) -> Step | None:
        """The next step, given the last one's outcome; None when the call is over (`result`, or it raised)."""
        made, outcome = self._outcome
        try:
            return self._steps.send(outcome) if made else self._steps.throw(outcome)
        except StopIteration as over:
            self.result = over.value
            return None

    def make(self, step: Callable[..., Any], *args: Any) -> None:
        try:
            self._outcome = (True, step(*args))
        except Exception as error:
            self._outcome = (False, error)

    async def amake(self, step: Awaitable[Any]) -> None:
        try:
            self._outcome = (True, await step)
        except Exception as error:
            self._outcome = (False, error)


@functools.cache
def _raising(rpc: AnyRpc[Result]) -> AnyRpc[Result]:
    """`rpc` without its `on_error`: its failure raised, so that several heads' failover sees it."""
    twin = copy.copy(rpc)
    twin.on_error = None
    return twin


class _Transport:
    """What both flavours share: the head's address, the default deadline, the token and TLS."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = checked_head_address(address or default_head_address())
        self.timeout_seconds = timeout_seconds
        self.security = security if security is not None else client_security()
        self._heads: dict[HeadProtocol, Head] = {}
        # Several heads (`a:11000,b:11000`): one client of the same flavour per head, and calls fail over among
        # them (`_failover_steps`). None with one head, whose call path is unchanged.
        self.addresses = split_head_addresses(self.address)
        self._members: dict[str, Self] | None = None
        if len(self.addresses) > 1:
            self._members = {one: self._one_head(one) for one in self.addresses}  # type: ignore[misc]  # Self in __init__

    def _one_head(self, address: str) -> Self:
        """A client like this one, of the head at `address` alone."""
        return type(self)(address, timeout_seconds=self.timeout_seconds, security=self.security)

    def following(self) -> str:
        """The head calls go to now: the address, or of several heads the one this process follows (the first
        until it fails to answer, then the next that did)."""
        if self._members is None:
            return self.address
        return _followed_heads.get(self.addresses, self.addresses[0])

    def skip(self, address: str) -> None:
        """`address` went away: with several heads, follow the next one in the list (no-op with one head, or when
        this process follows another already)."""
        if self._members is not None and self.following() == address and address in self.addresses:
            following = self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]
            self._follow(following, f"the head at {address} is unreachable")

    def _follow(self, address: str, why: str) -> None:
        if _followed_heads.get(self.addresses, self.addresses[0]) != address:
            _followed_heads[self.addresses] = address
            logger.warning("%s: following the head at %s now", why, address)

    def _member(self) -> Self:
        """The client of the head followed now (several heads only)."""
        assert self._members is not None
        return self._members[self.following()]

    def _failover_order(self) -> tuple[str, ...]:
        """The heads to try, the one followed first, then the others in the list's order after it."""
        at = self.addresses.index(self.following())
        return self.addresses[at:] + self.addresses[:at]

    def _failover_steps(
        self, rpc: AnyRpc[Result], call: Call[Any]
    ) -> Generator[tuple[Self, AnyRpc[Result], Call[Any]], Any, Result]:
        """A unary call over several heads: at the head followed, and, when it is unreachable, at the next one
        within what is left of the call's deadline (every control RPC may be made twice: they read state or are
        idempotent, gym_rpc.client.control._channel). The head that answered is followed from then on. Each step
        is a member's `_unary` call; the runner sends back its result or throws its failure in."""
        assert self._members is not None
        if rpc.on_error is not None:  # a row whose failure is a result: that result only once every head failed
            raising: AnyRpc[Result] = _raising(rpc)
            try:
                return (yield from self._failover_steps(raising, call))
            except ControlPlaneError as error:
                return rpc.on_error(error.code)
        order, started = self._failover_order(), time.monotonic()
        deadline = rpc.deadline_for(call, self.timeout_seconds)
        for attempt, address in enumerate(order):
            this_call = call if attempt == 0 else _rest_of(rpc, call, self.timeout_seconds, started)
            try:
                result: Result = yield self._members[address], rpc, this_call
            except HeadUnreachableError:
                left = None if deadline is None else deadline - (time.monotonic() - started)
                if attempt == len(order) - 1 or (left is not None and left <= 0):
                    raise
                continue
            if attempt:
                self._follow(address, f"the head at {order[0]} is unreachable")
            return result
        raise AssertionError("unreachable: the last attempt returns or raises")

    def head(self) -> Head:
        """The head at this client's address (looked at within the client's timeout if this process has not)."""
        if self._members is not None:
            return self._member().head()
        return self.head_of(
            head_protocol(self.address, tls=self.security.tls is not None, timeout=self.timeout_seconds)
        )

    def head_of(self, protocol: HeadProtocol) -> Head:
        """This client's head of `protocol` (`head_for`'s, kept: a call finds it without hashing the security)."""
        head = self._heads.get(protocol)
        if head is None:
            head = self._heads[protocol] = _head(protocol, self.address, self.security)
        return head

    def _look(self, rpc: AnyRpc[Any], call: Call[Any]) -> tuple[Head, Call[Any]]:
        """The head at the address, and the call with its deadline less the time the first look took (one
        connection, within the call's deadline: a slow head is still told apart)."""
        tls = self.security.tls is not None
        known = known_head_protocol(self.address, tls=tls)
        if known is not None:
            return self.head_of(known), call
        deadline = rpc.deadline_for(call, self.timeout_seconds)
        started = time.monotonic()
        protocol = head_protocol(self.address, tls=tls, timeout=deadline or DETECT_TIMEOUT_SECONDS)
        if deadline is not None:
            call = Call(call.request, max(deadline - (time.monotonic() - started), 0.001))
        return self.head_of(protocol), call

    async def _alook(self, rpc: AnyRpc[Any], call: Call[Any]) -> tuple[Head, Call[Any]]:
        """`_look` for the event loop: the first look at an address runs in a thread."""
        if known_head_protocol(self.address, tls=self.security.tls is not None) is None:
            return await asyncio.to_thread(self._look, rpc, call)
        return self._look(rpc, call)


class BlockingTransport(_Transport, BlockingCallPath):
    """The one blocking call path: the head seam's steps, each made blocking."""

    def unary(self, rpc: AnyRpc[Result], *args: Any, **kwargs: Any) -> Result:
        if self._members is not None:
            return self._failover(rpc, rpc.build(*args, **kwargs))
        return self._unary(rpc, rpc.build(*args, **kwargs))

    def _unary(self, rpc: AnyRpc[Result], call: Call[Any]) -> Result:
        run = _Run(_unary_steps(self, rpc, call))
        while (step := run.next_step()) is not None:
            run.make(self._make, rpc, step)
        return run.result

    def _failover(self, rpc: AnyRpc[Result], call: Call[Any]) -> Result:
        run = _Run(self._failover_steps(rpc, call))
        while (step := run.next_step()) is not None:
            member, member_rpc, this_call = step
            run.make(member._unary, member_rpc, this_call)
        return run.result

    def _make(self, rpc: AnyRpc[Any], step: _Step) -> Any:
        if step.head is None:
            return self._look(rpc, step.call)
        return step.head.unary(rpc, step.call, self.timeout_seconds)

    def stream(self, rpc: AnyRpc[Result], *args: Any, **kwargs: Any) -> Generator[Result, None, None]:
        """The stream from the head (of several, the one followed: `StatusWatch` moves on when it goes away)."""
        at = self if self._members is None else self._member()
        head, call = at._look(rpc, rpc.build(*args, **kwargs))
        yield from head.stream(rpc, call, self.timeout_seconds)


class AsyncTransport(_Transport, AsyncCallPath):
    """The one asyncio call path: the head seam's steps, each awaited."""

    async def unary(self, rpc: AnyRpc[Result], *args: Any, **kwargs: Any) -> Result:
        if self._members is not None:
            return await self._failover(rpc, rpc.build(*args, **kwargs))
        return await self._unary(rpc, rpc.build(*args, **kwargs))

    async def _unary(self, rpc: AnyRpc[Result], call: Call[Any]) -> Result:
        run = _Run(_unary_steps(self, rpc, call))
        while (step := run.next_step()) is not None:
            await run.amake(self._amake(rpc, step))
        return run.result

    async def _failover(self, rpc: AnyRpc[Result], call: Call[Any]) -> Result:
        run = _Run(self._failover_steps(rpc, call))
        while (step := run.next_step()) is not None:
            member, member_rpc, this_call = step
            await run.amake(member._unary(member_rpc, this_call))
        return run.result

    async def _amake(self, rpc: AnyRpc[Any], step: _Step) -> Any:
        if step.head is None:
            return await self._alook(rpc, step.call)
        return await step.head.aunary(rpc, step.call, self.timeout_seconds)

    async def stream(self, rpc: AnyRpc[Result], *args: Any, **kwargs: Any) -> AsyncGenerator[Result, None]:
        at = self if self._members is None else self._member()  # of several heads, the one followed
        head, call = await at._alook(rpc, rpc.build(*args, **kwargs))
        results = head.astream(rpc, call, self.timeout_seconds)
        try:
            async for result in results:
                yield result
        finally:
            await results.aclose()
