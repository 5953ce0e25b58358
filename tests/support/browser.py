"""A real headless browser for tests: Debian's `chromium`, driven through its DevTools protocol (CDP) over a
websocket (aiohttp's client: no driver to download, nothing fetched at run time).

`headless_chromium()` starts one with a fresh profile and the flags that keep it off the network (no background
fetches, updates, sync or QUIC), on a 1,280 x 800 window, and yields a `Page` to drive: navigate, evaluate
JavaScript, wait for a condition, take a screenshot, list every URL it requested. Every wait is bounded; the
browser is killed on exit. `chromium_path()` is None where no chromium is installed (.ci/run installs it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

START_SECONDS = 30.0  # a cold chromium on two busy cores
CALL_SECONDS = 15.0
WIDTH, HEIGHT = 1280, 800
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-default-browser-check",
    "--no-proxy-server",
    "--disable-dev-shm-usage",
    f"--window-size={WIDTH},{HEIGHT}",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserError(AssertionError):
    """The browser did something a test did not expect (a JavaScript exception, no answer in time)."""


class Page:
    """One tab, driven over CDP."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.requested: list[str] = []  # every URL the page asked for (Network.requestWillBeSent)
        self.console: list[str] = []  # console messages and exceptions
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self._ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(message.data)
            if "id" in data:
                future = self._waiting.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Network.requestWillBeSent":
                self.requested.append(params["request"]["url"])
            elif method == "Runtime.consoleAPICalled":
                self.console.append(
                    " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
                )
            elif method == "Runtime.exceptionThrown":
                self.console.append(f"exception: {params['exceptionDetails']}")
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(BrowserError("the browser closed its DevTools connection"))

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        call_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        await self._ws.send_str(json.dumps({"id": call_id, "method": method, "params": params}))
        try:
            answer = await asyncio.wait_for(future, CALL_SECONDS)
        except TimeoutError:
            raise BrowserError(f"{method}: no answer from the browser within {CALL_SECONDS:g} s") from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited when it is a promise)."""
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, interval: float = 0.05) -> Any:
        """Evaluate `expression` until it is truthy; its value. Fails after `timeout` seconds with the last one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if loop.time() >= deadline:
                raise BrowserError(f"{expression!r} still {value!r} after {timeout:g} s; console: {self.console}")
            await asyncio.sleep(interval)

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for("document.readyState === 'complete'", CALL_SECONDS)

    async def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode((await self.send("Page.captureScreenshot", format="png"))["data"])
        await asyncio.to_thread(path.write_bytes, data)
        return data

    async def close(self) -> None:
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


async def _devtools_url(process: asyncio.subprocess.Process) -> str:
    assert process.stderr is not None
    seen: list[str] = []
    while True:
        line = (await process.stderr.readline()).decode(errors="replace")
        if not line:
            raise BrowserError(f"chromium ended before it listened: {''.join(seen)[-2000:]}")
        seen.append(line)
        match = _LISTENING.search(line)
        if match:
            return match.group(1)


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


@contextlib.asynccontextmanager
async def headless_chromium() -> AsyncIterator[Page]:
    """A fresh headless chromium with one blank tab, 1,280 x 800, its network requests recorded."""
    executable = chromium_path()
    assert executable is not None, "no chromium: apt-get install -y chromium (.ci/run does)"
    profile = tempfile.mkdtemp(prefix="gym-rpc-chromium-")
    process = await asyncio.create_subprocess_exec(
        executable,
        *FLAGS,
        f"--user-data-dir={profile}",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    drain: asyncio.Task[None] | None = None
    try:
        browser_url = await asyncio.wait_for(_devtools_url(process), START_SECONDS)
        assert process.stderr is not None
        drain = asyncio.create_task(_drain(process.stderr))
        port = int(browser_url.split(":")[2].split("/")[0])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_SECONDS)) as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            page_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
            ws = await session.ws_connect(page_url, max_msg_size=0, timeout=aiohttp.ClientWSTimeout(ws_close=5))
            page = Page(ws)
            try:
                await page.send("Network.enable")
                await page.send("Runtime.enable")
                await page.send("Page.enable")
                await page.send(
                    "Emulation.setDeviceMetricsOverride",
                    width=WIDTH,
                    height=HEIGHT,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                yield page
            finally:
                await page.close()
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()
        if drain is not None:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain
        shutil.rmtree(profile, ignore_errors=True)
