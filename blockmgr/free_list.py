"""Free-block queue: a doubly linked list over block ids with O(1) everything.

Allocation takes from the head (the least recently freed block); freeing appends to the
tail; a prefix-cache hit on a free block unlinks it from the middle. Links live in two
flat lists indexed by block id, with one sentinel node (index ``num_blocks``) that is
both the head's predecessor and the tail's successor. A block not in the queue has both
links set to ``-1``.
"""

from __future__ import annotations

from collections.abc import Iterator

_UNLINKED = -1


class FreeBlockQueue:
    """FIFO of free block ids supporting O(1) removal of any member."""

    __slots__ = ("_prev", "_next", "_sentinel", "_num_free")

    def __init__(self, num_blocks: int) -> None:
        """Start with every block free, in id order (block 0 at the head)."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        n = num_blocks
        self._sentinel = n
        # Node i links to i-1 and i+1; the sentinel closes the ring.
        self._prev = [i - 1 for i in range(n + 1)]
        self._next = [i + 1 for i in range(n + 1)]
        self._prev[0] = n
        self._next[n - 1] = n
        self._prev[n] = n - 1
        self._next[n] = 0
        self._num_free = n

    def __len__(self) -> int:
        return self._num_free

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] != _UNLINKED

    def popleft(self) -> int:
        """Remove and return the head block. The queue must not be empty."""
        if self._num_free == 0:
            raise IndexError("no free blocks")
        block_id = self._next[self._sentinel]
        self.remove(block_id)
        return block_id

    def append(self, block_id: int) -> None:
        """Add a block (not in the queue) at the tail."""
        if self._prev[block_id] != _UNLINKED:
            raise ValueError(f"block {block_id} is already free")
        s = self._sentinel
        tail = self._prev[s]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = s
        self._prev[s] = block_id
        self._num_free += 1

    def remove(self, block_id: int) -> None:
        """Unlink a block that is in the queue, wherever it is."""
        prev = self._prev[block_id]
        if prev == _UNLINKED:
            raise ValueError(f"block {block_id} is not free")
        nxt = self._next[block_id]
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = _UNLINKED
        self._next[block_id] = _UNLINKED
        self._num_free -= 1

    def __iter__(self) -> Iterator[int]:
        """Block ids from head to tail (for checks and tests; O(n))."""
        s = self._sentinel
        node = self._next[s]
        steps = 0
        while node != s:
            yield node
            node = self._next[node]
            steps += 1
            if steps > s:
                raise AssertionError("free list has a cycle")

    def check(self) -> list[int]:
        """Verify the links; return the members head to tail. Raises AssertionError."""
        s = self._sentinel
        members = []
        prev = s
        for node in self:
            assert self._prev[node] == prev, (
                f"free list: prev link of block {node} is {self._prev[node]}, expected {prev}"
            )
            members.append(node)
            prev = node
        assert self._prev[s] == prev, "free list: tail link is broken"
        assert len(members) == self._num_free, (
            f"free list: {len(members)} linked blocks but num_free={self._num_free}"
        )
        return members
