"""Doubly linked lists with O(1) unlink, insert and rotate (qmgr.h's ``QMGR_LIST_*``).

nqmgr's structures sit on several lists at once (a job is on its transport's scheduler
list, on its by-time list, and maybe on a parent's children list) and leave them from
the middle all the time. Python's list and deque make that O(n); a node per membership
keeps every operation O(1), as stock's intrusive lists do. Each structure keeps the
node of each list it is on (``job.list_node``, ``job.time_node``, ...).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Node(Generic[T]):
    __slots__ = ("item", "prev", "next", "owner")

    def __init__(self, item: T) -> None:
        self.item = item
        self.prev: Node[T] | None = None
        self.next: Node[T] | None = None
        #: The list this node is on, None when unlinked.
        self.owner: QList[T] | None = None


class QList(Generic[T]):
    __slots__ = ("head", "tail", "size")

    def __init__(self) -> None:
        self.head: Node[T] | None = None
        self.tail: Node[T] | None = None
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.head is not None

    def __iter__(self) -> Iterator[T]:
        """Items head to tail; the current node may be unlinked while iterating."""
        node = self.head
        while node is not None:
            nxt = node.next
            yield node.item
            node = nxt

    def first(self) -> T | None:
        return None if self.head is None else self.head.item

    def last(self) -> T | None:
        return None if self.tail is None else self.tail.item

    def append(self, node: Node[T]) -> Node[T]:
        return self.link(self.tail, node, None)

    def prepend(self, node: Node[T]) -> Node[T]:
        return self.link(None, node, self.head)

    def link(self, prev: Node[T] | None, node: Node[T], nxt: Node[T] | None) -> Node[T]:
        """Put ``node`` between neighbours ``prev`` and ``nxt`` (``QMGR_LIST_LINK``)."""
        assert node.owner is None, "node already on a list"
        node.prev = prev
        node.next = nxt
        if prev is None:
            self.head = node
        else:
            prev.next = node
        if nxt is None:
            self.tail = node
        else:
            nxt.prev = node
        node.owner = self
        self.size += 1
        return node

    def unlink(self, node: Node[T]) -> None:
        assert node.owner is self, "node not on this list"
        prev, nxt = node.prev, node.next
        # The mirror of link(): a missing neighbour means the list's end moves.
        if prev is not None:
            prev.next = nxt
        else:
            self.head = nxt
        if nxt is not None:
            nxt.prev = prev
        else:
            self.tail = prev
        node.prev = node.next = None
        node.owner = None
        self.size -= 1

    def rotate(self, node: Node[T]) -> None:
        """Make ``node`` the tail, keeping cyclic order (``QMGR_LIST_ROTATE``).

        The next scan from the head then starts right after the node chosen last,
        which is how stock round-robins over transports and over a job's peers.
        """
        if node is self.tail:
            return
        assert self.head is not None and self.tail is not None
        self.head.prev = self.tail
        self.tail.next = self.head
        new_head = node.next
        assert new_head is not None
        new_head.prev = None
        self.head = new_head
        self.tail = node
        node.next = None
