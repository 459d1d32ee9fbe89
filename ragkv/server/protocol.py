"""uvicorn's h11 protocol with a header-read timeout (uvicorn has none: slowloris held connections).

A connection must deliver a complete request head within ``seconds`` of opening, and again of
each response finishing (a kept-alive connection's next request); otherwise it is closed. Body
reads are not timed here: the handlers' own limits and the disconnect checks cover them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["header_timeout_protocol"]


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """An ``H11Protocol`` subclass that closes connections slower than ``seconds`` to send a request head."""
    if seconds <= 0:
        raise ValueError(f"the header timeout must be positive, got {seconds}")

    class HeaderTimeoutH11(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _before: Any = None  # the request cycle when the timer started: a new one means a head arrived

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._before = self.cycle
            self._timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.cycle is self._before and not self.transport.is_closing():
                self.transport.close()  # no request head in time

    return HeaderTimeoutH11
