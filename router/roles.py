"""Switching a worker between prefill and decode (`pdmesh role`, MeshControl.SetWorkerRole).

The router owns the switch because it alone knows every worker and what it sends them: it
refuses a switch that would leave a role with no worker in rotation, takes the worker out of
both rotations at once (no new work of its old role goes there), asks the worker to switch
(WorkerRole.SetRole: a decode worker first moves its running requests to the other decode
workers with their KV, a prefill worker first finishes its prefills), and dispatches to it by
its new role once it has switched. Switches run one at a time, so two cannot each leave the
other's role empty.
"""

from __future__ import annotations

import asyncio

import grpc

from pdmesh.errors import FailedPrecondition, InvalidRequest, NotFound, from_status
from pdmesh.logger import get_logger
from pdmesh.router.dispatch import LINK_WAIT_S, Dispatcher
from pdmesh.router.registry import Worker, WorkerRegistry
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

log = get_logger(__name__)

ROLES = ("prefill", "decode")
# A switch waits for the worker's running requests to move away (each pulled within the
# worker's --kv-timeout) or for its prefills to end (each within --prefill-timeout).
SWITCH_TIMEOUT_S = 600.0


class RoleSwitcher:
    def __init__(self, registry: WorkerRegistry, dispatcher: Dispatcher) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self._one_at_a_time = asyncio.Lock()

    async def set_role(self, address: str, role: str) -> worker_pb2.SetRoleReply:
        """Switch the worker at `address` to `role`; what the switch did. InvalidRequest for an
        unknown role, NotFound for an unknown worker, FailedPrecondition for a worker that cannot
        switch or is the last of its role in rotation; the worker's own error otherwise."""
        if role not in ROLES:
            raise InvalidRequest(f"role must be one of {', '.join(ROLES)}, got {role!r}.", "role")
        w = self.registry.find(address)
        if w is None:
            known = ", ".join(x.address for x in self.registry.workers)
            raise NotFound(f"worker {address!r} is not one of this router's workers ({known}).")
        async with self._one_at_a_time:
            if w.role == role:
                return worker_pb2.SetRoleReply(role=role)
            self._check(w, role)
            w.switching = True
            w.role_epoch += 1
            try:
                reply = await self._ask(w, role)
                w.take_role(reply.role)
            finally:
                w.switching = False
                w.role_epoch += 1
            if w.role == "decode":  # its token stream to this router, before the first request
                await self._linked(w)
            log.info("worker %s switched from %s to %s", address, reply.previous, reply.role)
            return reply

    def _check(self, w: Worker, role: str) -> None:
        if role not in w.roles:
            raise FailedPrecondition(
                f"worker {w.address} serves only {w.role} (`pdmesh {w.role}`); start it as "
                "`pdmesh worker` to switch its role."
            )
        others = [x for x in self.registry.healthy(w.role) if x is not w]
        if not others:
            raise FailedPrecondition(
                f"worker {w.address} is the last {w.role} worker in rotation; switching it "
                f"would leave none."
            )

    @staticmethod
    async def _ask(w: Worker, role: str) -> worker_pb2.SetRoleReply:
        assert w.channel is not None
        stub = worker_pb2_grpc.WorkerRoleStub(w.channel)
        try:
            return await stub.SetRole(
                worker_pb2.SetRoleRequest(role=role), timeout=SWITCH_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:  # stats not read yet, or an old worker
                raise FailedPrecondition(
                    f"worker {w.address} cannot switch its role (it serves only {w.role})."
                ) from None
            detail = f"worker {w.address} did not switch: {e.details()}"
            raise from_status(e.code().name, detail) from None

    async def _linked(self, w: Worker) -> None:
        link = self.dispatcher.link(w)
        try:
            await asyncio.wait_for(link.connected.wait(), LINK_WAIT_S)
        except TimeoutError:
            log.warning("worker %s serves decode, its token stream not open yet", w.address)
