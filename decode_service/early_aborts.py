"""Aborts that reach a decode worker before the request they name runs there.

A router cancels a request with an Abort RPC of its own, which can overtake the request's Submit
(the two are separate calls) or land while Submit still awaits a grammar compile, a KV-store
fetch or the engine thread's admission. Each such abort must still end the request, or it runs
for nobody and its blocks stay taken until it ends (a remote prefill's reservation: forever).

Event loop only. What callers may rely on:
- `begin(rid)` raises Cancelled for a request aborted before its Submit arrived (remembered for
  the last REMEMBERED such ids: request ids are unique per attempt);
- `aborted(rid)` is True, between `begin` and `end`, once an abort named `rid`;
- `end(rid)` forgets `rid`.
"""

from __future__ import annotations

from collections import OrderedDict

from pdmesh.errors import Cancelled

REMEMBERED = 4096


class EarlyAborts:
    def __init__(self) -> None:
        self._submitting: set[str] = set()  # requests whose Submit is still under way
        self._aborted: set[str] = set()  # of those, the ones an abort named
        self._before: OrderedDict[str, None] = OrderedDict()  # aborted before their Submit

    def begin(self, request_id: str) -> None:
        if request_id in self._before:
            del self._before[request_id]
            raise Cancelled(f"request {request_id!r} was aborted before it was submitted.")
        self._submitting.add(request_id)

    def aborted(self, request_id: str) -> bool:
        return request_id in self._aborted

    def end(self, request_id: str) -> None:
        self._submitting.discard(request_id)
        self._aborted.discard(request_id)

    def abort(self, request_id: str, known: bool) -> None:
        """An abort named `request_id`; `known`: the worker runs (or ran) a request of that id."""
        if request_id in self._submitting:
            self._aborted.add(request_id)
        elif not known:
            self._before[request_id] = None
            if len(self._before) > REMEMBERED:
                self._before.popitem(last=False)
