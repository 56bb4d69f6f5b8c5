"""One `Connect` stream as the loop thread sees it, and who asked for each scheduler rid."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

from minisgl_core.proto.minisgl.v1 import scheduler_pb2


@dataclass(eq=False)
class Conn:
    """A gateway's Connect stream. The loop thread owns `rids`, `half_closed` and `ended`; the
    stream's gRPC thread only reads `outbox` (one ConnectResponse per loop iteration, None: end)."""

    id: int
    outbox: queue.Queue[scheduler_pb2.ConnectResponse | None] = field(default_factory=queue.Queue)
    rids: dict[int, int] = field(default_factory=dict)  # client rid -> scheduler rid
    half_closed: bool = False  # the client sends no more; end the stream when its requests end
    ended: bool = False


@dataclass(slots=True)
class Owner:
    """Where a scheduler rid's token updates go."""

    conn: Conn
    client_rid: int
