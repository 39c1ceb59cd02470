"""omni-box 0.3.1 as a peer of this library on one inbox table (scenarios Z-05 and Z-06).

Run by `outbox_conformance::inbox::peer::OmniBoxPeer` with the interpreter of the virtual
environment `scripts/omnibox install` makes. It speaks JSON lines: each request on stdin is
`{"id": n, "op": "...", ...}` and gets exactly one reply `{"id": n, "ok": true, ...}` or
`{"id": n, "ok": false, "error": "..."}` on stdout. Requests run concurrently, so a caller can
start an operation that blocks (a landing waiting for a lock, a handler held at a gate) and
go on with others; `started` replies come when a gated handler has begun.

It uses omni-box's own classes only: `InboxConsumerRunner` fed by a one-message consumer,
`create_inbox_processor` over `PostgresInboxRepository`, and `PostgresInboxRepository.create`.
Handlers write one effect row in the inbox transaction (the repository's session), with the
statement given to `init` as `effects_insert` (its `:m` is the message id).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import traceback
from typing import Any

import structlog

from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from omni_box.application.factories import create_inbox_processor
from omni_box.application.services.consume import InboxConsumerRunner
from omni_box.core.protocols import ConsumedMessage, EventConsumer, NullAckHandle
from omni_box.core.services.domain import OmniBoxDomainService
from omni_box.infra.storage.postgres import InboxEventDBBase, InboxEventPartitionedDBBase
from omni_box.infra.storage.postgres.repositories.inbox import PostgresInboxRepository


class _Gate:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.opened = asyncio.Event()


class _OneMessage(EventConsumer):
    """A consumer that yields one message, with an ack handle that records what happened."""

    def __init__(self, message: ConsumedMessage) -> None:
        self._message = message

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def getone(self) -> ConsumedMessage:
        return self._message


class _Recording(NullAckHandle):
    def __init__(self) -> None:
        self.committed = False
        self.rewound = False

    async def commit(self) -> None:
        self.committed = True

    async def rewind(self) -> None:
        self.rewound = True


class Peer:
    def __init__(self) -> None:
        self.engine = None
        self.sessions = None
        self.model = None
        self.group = "g"
        self.worker = "omnibox-1"
        self.gates: dict[str, _Gate] = {}
        self.effects_insert = "INSERT INTO effects (message_id, party) VALUES (:m, 'omnibox')"

    def gate(self, name: str) -> _Gate:
        if name not in self.gates:
            self.gates[name] = _Gate()
        return self.gates[name]

    async def init(self, req: dict[str, Any]) -> dict[str, Any]:
        schema = req["schema"]
        table = req["table"]
        self.group = req.get("group", self.group)
        self.worker = req.get("worker", self.worker)
        self.effects_insert = req.get("effects_insert", self.effects_insert)
        dsn = req["dsn"].replace("postgres://", "postgresql+asyncpg://", 1)
        if dsn.startswith("postgresql://"):
            dsn = dsn.replace("postgresql://", "postgresql+asyncpg://", 1)
        self.engine = create_async_engine(
            dsn, connect_args={"server_settings": {"search_path": schema}}, pool_size=8
        )
        self.sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        # The processor runs each statement in its own transaction, so the lease its fetch
        # stamps is committed (visible to other workers) before its handlers run.
        self.autocommit = async_sessionmaker(
            self.engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
        )

        class Base(DeclarativeBase):
            pass

        mixin = InboxEventPartitionedDBBase if req.get("partitioned") else InboxEventDBBase
        self.model = type("PeerInboxEvent", (mixin, Base), {"__tablename__": table})
        return {}

    def repo(self, session: Any) -> PostgresInboxRepository:
        return PostgresInboxRepository(session, model_class=self.model)

    async def handler_for(self, req: dict[str, Any]):
        gate = self.gate(req["gate"]) if req.get("gate") else None

        async def handler(event: Any, repo: Any) -> None:
            if gate is not None:
                gate.started.set()
                await gate.opened.wait()
            await repo.session.execute(text(self.effects_insert), {"m": event.message_id})
            return None

        return handler

    def message(self, m: dict[str, Any], ack: _Recording) -> ConsumedMessage:
        return ConsumedMessage(
            message_id=m["message_id"],
            source=m.get("source", "orders"),
            event_type=m.get("event_type", "order.placed"),
            payload=m.get("payload") or {"message": m["message_id"]},
            headers=m.get("headers"),
            ack_handle=ack,
        )

    async def runner(self, req: dict[str, Any]) -> dict[str, Any]:
        """omni-box's runner, given one message; with or without a handler."""
        sessions = self.sessions

        class Provider:
            def transaction(inner_self):  # noqa: N805
                return _Tx(sessions, self.repo)

        ack = _Recording()
        handler = await self.handler_for(req) if req.get("handler") else None
        runner = InboxConsumerRunner(
            _OneMessage(self.message(req["message"], ack)),
            Provider(),
            handler,
            worker_id=self.worker,
            consumer_group=self.group,
            domain_service=OmniBoxDomainService(),
        )
        await runner.start()
        try:
            result = await runner.process_one()
        finally:
            await runner.stop()
        return {
            "committed": result.committed,
            "processed": result.processed,
            "duplicate": result.duplicate,
            "event_id": str(result.event_id) if result.event_id else None,
            "acked": ack.committed,
            "rewound": ack.rewound,
        }

    async def process(self, req: dict[str, Any]) -> dict[str, Any]:
        """One batch of omni-box's inbox processor; each statement commits on its own, so the
        fetch's lease is stamped (committed) before the handlers run."""
        handler = await self.handler_for(req)
        async with self.autocommit() as session:
            processor = create_inbox_processor(self.repo(session), handler)
            result = await processor.process_batch(self.worker, int(req.get("batch", 10)))
        return {
            "processed": [str(i) for i in result.processed_event_ids],
            "failed": len(result.failed_counted) + len(result.failed_noncounted),
        }

    async def create(self, req: dict[str, Any]) -> dict[str, Any]:
        """`repo.create(m)` in a transaction of its own, committed after `hold_ms`."""
        event = OmniBoxDomainService().create_inbox_event(
            message_id=req["message"]["message_id"],
            consumer_group=self.group,
            source=req["message"].get("source", "orders"),
            event_type=req["message"].get("event_type", "order.placed"),
            payload=req["message"].get("payload") or {"message": req["message"]["message_id"]},
        )
        async with self.sessions() as session:
            async with session.begin():
                stored = await self.repo(session).create(event)
                if req.get("gate"):
                    g = self.gate(req["gate"])
                    g.started.set()
                    await g.opened.wait()
        return {"row_id": str(stored.id), "inserted": stored.id == event.id}

    async def started(self, req: dict[str, Any]) -> dict[str, Any]:
        await asyncio.wait_for(self.gate(req["gate"]).started.wait(), timeout=30)
        return {}

    async def open(self, req: dict[str, Any]) -> dict[str, Any]:
        self.gate(req["gate"]).opened.set()
        return {}

    async def close(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.engine is not None:
            await self.engine.dispose()
        return {}


class _Tx:
    """omni-box's transaction provider contract: a repository on a session in a transaction."""

    def __init__(self, sessions: Any, repo: Any) -> None:
        self._sessions = sessions
        self._repo = repo
        self._session = None
        self._tx = None

    async def __aenter__(self) -> Any:
        self._session = self._sessions()
        await self._session.__aenter__()
        self._tx = self._session.begin()
        await self._tx.__aenter__()
        return self._repo(self._session)

    async def __aexit__(self, *exc: Any) -> bool:
        try:
            await self._tx.__aexit__(*exc)
        finally:
            await self._session.__aexit__(*exc)
        return False


async def serve() -> None:
    # stdout carries the replies alone: omni-box's logs go to stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr))
    peer = Peer()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out_lock = asyncio.Lock()
    tasks: set[asyncio.Task[None]] = set()

    async def reply(obj: dict[str, Any]) -> None:
        async with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    async def run(req: dict[str, Any]) -> None:
        try:
            op = getattr(peer, req["op"])
            result = await op(req)
            await reply({**result, "id": req["id"], "ok": True})
        except Exception as e:  # the caller decides what a failure means
            await reply(
                {
                    "id": req.get("id"),
                    "ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(limit=5),
                }
            )

    while True:
        line = await reader.readline()
        if not line:
            break
        req = json.loads(line)
        task = asyncio.create_task(run(req))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    if peer.engine is not None:
        await peer.engine.dispose()


if __name__ == "__main__":
    asyncio.run(serve())
