"""Tenant turns: the order in which the waiting queue serves tenants of one priority.

Start-time fair queuing with a unit cost per admitted request: each (priority, tenant) group has
the turn of its last admission; its next waiting request gets the turn after that, but never one
earlier than the priority's current turn (`vtime`), so a tenant that was idle gets no credit to
burst with later. Lower turns are admitted first, arrival breaks ties. One tenant flooding the
queue therefore gets every other turn against a second tenant, not all of them.
"""

from __future__ import annotations

from minisgl_scheduler.request import Request

Group = tuple[int, int]  # (priority, tenant)

# Groups whose last turn is behind their priority's vtime start there anyway: forget them, so
# that a stream of one-off tenants cannot grow the table without bound.
_PRUNE_AT = 1024


class TenantTurns:
    def __init__(self) -> None:
        self.vtime: dict[int, int] = {}  # priority -> turn of its latest admission
        self.last: dict[Group, int] = {}  # group -> turn of its latest admission

    def _start(self, group: Group) -> int:
        now = self.vtime.get(group[0], 0)
        last = self.last.get(group)
        return now if last is None else max(last + 1, now)

    def order(self, waiting: list[Request]) -> list[Request]:
        """`waiting` (in arrival order) by priority, then turn, then arrival."""
        nexts: dict[Group, int] = {}
        keys: dict[int, tuple[int, int, int]] = {}
        for r in waiting:
            group = (r.priority, r.tenant)
            turn = nexts.get(group)
            if turn is None:
                turn = self._start(group)
            nexts[group] = turn + 1
            keys[id(r)] = (r.priority, turn, r.arrival)
        return sorted(waiting, key=lambda r: keys[id(r)])

    def admitted(self, req: Request) -> None:
        group = (req.priority, req.tenant)
        turn = self._start(group)
        self.last[group] = turn
        self.vtime[req.priority] = max(self.vtime.get(req.priority, 0), turn)
        if len(self.last) > _PRUNE_AT:
            self.last = {g: t for g, t in self.last.items()
                         if t + 1 > self.vtime.get(g[0], 0)}
