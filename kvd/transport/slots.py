"""Fixed-size slots of a registered staging/bounce region, shared fairly between transfers.

The receive region on the gen side and the send staging region on the ctx side are each
cut into ``chunk_bytes`` slots. Transfers ask for slots; when slots are short they are
handed out round-robin over the transfers that are waiting, one slot per turn, so one big
request cannot starve the others ("several requests in flight share the bounce regions
fairly"). Every slot given out is tracked per owner so that a failed or cancelled
transfer's slots are all reclaimed (``release_owner``).

A slot may also be taken *ahead* (:meth:`try_acquire_ahead`): by work that starts before it
holds the other resource it needs (a bounce chunk gathered before gen granted its receive
slot). At most ``count - 1`` slots are held ahead at any time, so one is always left for
owners that hold everything else: they never wait on holders that wait for them.

An owner's slots are all taken back at once when its transfer reports (``release_owner``),
which drops its waiters. A waiter already handed a slot but not yet run (woken, waiting for
the next scheduler pass) finds the slot gone when it runs: :meth:`SlotPool.acquire` then
raises :class:`SlotsReclaimed` instead of returning a slot its owner no longer holds.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import trio

from protocol.errors import TransferCancelled


class SlotsReclaimed(TransferCancelled):
    """The slot handed to a waiting :meth:`SlotPool.acquire` was taken back with the rest of
    its owner's slots (:meth:`SlotPool.release_owner`: the owner's transfer ended) before the
    waiter ran: the owner holds nothing, and must take nothing more."""


class SlotPool:
    """``count`` slots, handed out fairly to owners (request ids)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError("a slot pool needs at least one slot")
        self.count = count
        self._free: deque[int] = deque(range(count))
        self._owned: dict[str, set[int]] = {}
        # owner -> queue of (event, box) waiting for one slot each; OrderedDict = round-robin order
        self._waiting: OrderedDict[str, deque[tuple[trio.Event, list[int]]]] = OrderedDict()
        #: slots held ahead (see the module's docstring), until settled or released
        self._ahead: set[int] = set()

    @property
    def in_use(self) -> int:
        return self.count - len(self._free)

    def owned_by(self, owner: str) -> set[int]:
        return set(self._owned.get(owner, ()))

    def owns(self, owner: str, slot: int) -> bool:
        """Whether ``owner`` holds ``slot`` (no copy of its set: checked for every chunk)."""
        owned = self._owned.get(owner)
        return owned is not None and slot in owned

    async def acquire(self, owner: str) -> int:
        """Wait for one slot for ``owner``; cancellable without losing the slot. Raises
        :class:`SlotsReclaimed` when the slot handed over was taken back (``release_owner``)
        before this task ran: a woken task runs on even when cancelled meanwhile."""
        if self._free and not self._waiting:
            return self._give(owner, self._free.popleft())
        event, box = trio.Event(), list[int]()
        self._waiting.setdefault(owner, deque()).append((event, box))
        try:
            await event.wait()
        except BaseException:
            if not box:
                self._drop_waiter(owner, event)
            elif self.owns(owner, box[0]):  # granted while we were being cancelled: give it back
                self.release(owner, box[0])
            raise
        slot = box[0]
        if not self.owns(owner, slot):
            raise SlotsReclaimed(
                f"slot {slot}, handed to {owner!r}, was taken back with the rest of its slots"
            )
        return slot

    def try_acquire(self, owner: str) -> int | None:
        """A slot now, or None."""
        if self._free and not self._waiting:
            return self._give(owner, self._free.popleft())
        return None

    def try_acquire_ahead(self, owner: str) -> int | None:
        """A slot now for work that does not yet hold its other resource, or None: none free,
        owners waiting, or ``count - 1`` slots held ahead already. :meth:`settle` it once the
        other resource is held; :meth:`release` ends it either way."""
        if len(self._ahead) >= self.count - 1:
            return None
        slot = self.try_acquire(owner)
        if slot is not None:
            self._ahead.add(slot)
        return slot

    def settle(self, slot: int) -> None:
        """``slot``, taken ahead, is now held with everything else its holder needs."""
        self._ahead.discard(slot)

    @property
    def ahead(self) -> int:
        """Slots held ahead now."""
        return len(self._ahead)

    def release(self, owner: str, slot: int) -> None:
        """Return one slot; it goes to the next waiting owner in round-robin order."""
        owned = self._owned.get(owner)
        if owned is None or slot not in owned:
            raise ValueError(f"slot {slot} is not held by {owner!r}")
        owned.discard(slot)
        if not owned:
            del self._owned[owner]
        self._ahead.discard(slot)
        self._hand_out(slot)

    def release_owner(self, owner: str) -> int:
        """Return every slot ``owner`` holds and drop its waiters; returns how many slots."""
        slots = self._owned.pop(owner, set())
        self._waiting.pop(owner, None)
        for slot in slots:
            self._ahead.discard(slot)
            self._hand_out(slot)
        return len(slots)

    def _give(self, owner: str, slot: int) -> int:
        self._owned.setdefault(owner, set()).add(slot)
        return slot

    def _hand_out(self, slot: int) -> None:
        while self._waiting:
            owner, queue = next(iter(self._waiting.items()))
            event, box = queue.popleft()
            # round-robin: this owner goes to the back of the line
            del self._waiting[owner]
            if queue:
                self._waiting[owner] = queue
            box.append(self._give(owner, slot))
            event.set()
            return
        self._free.append(slot)

    def _drop_waiter(self, owner: str, event: trio.Event) -> None:
        queue = self._waiting.get(owner)
        if queue is None:
            return
        for i, (ev, _box) in enumerate(queue):
            if ev is event:
                del queue[i]
                break
        if not queue:
            del self._waiting[owner]
