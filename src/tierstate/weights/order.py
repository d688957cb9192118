"""The order blocks are used in, learned from the last step, to read the next ones ahead.

ZeRO-3's prefetcher records the order of module calls during the first step and replays
it; so does this. Before any step the guess is forward in model order, then backward in
reverse. Each use is matched against the expected sequence; a use elsewhere re-synchronizes
to its next occurrence (a skipped block, a conditional branch), and one not expected at all
counts as an order change. At the end of every backward the sequence just seen becomes the
expectation, so a model whose order changes is followed from the next step on.
"""
from __future__ import annotations


class UseOrder:
    def __init__(self, nblocks: int, depth: int) -> None:
        self.depth = depth
        self.expected: list[int] = list(range(nblocks)) + list(reversed(range(nblocks)))
        self.pos = 0
        self.seen: list[int] = []
        self.changes = 0  # steps whose sequence differed from the one before
        self._nblocks = nblocks

    def note(self, b: int) -> list[int]:
        """Record a use of block ``b``; the blocks expected next (at most ``depth``), ``b`` excluded."""
        if not self.seen or self.seen[-1] != b:
            self.seen.append(b)
        exp = self.expected
        if self.pos < len(exp) and exp[self.pos] == b:
            self.pos += 1
        elif self.pos > 0 and exp[self.pos - 1] == b:
            pass  # the same block again (a recomputation, a second output): no move
        else:
            try:
                self.pos = exp.index(b, self.pos) + 1
            except ValueError:
                self.pos = len(exp)  # not expected here: no guess until the order is learned again
        if len(self.seen) > 4 * max(len(exp), 2 * self._nblocks):  # many forwards, no backward (inference)
            self.commit()
        nxt = []
        for u in exp[self.pos:]:
            if len(nxt) == self.depth:
                break
            if u != b and u not in nxt:
                nxt.append(u)
        return nxt

    def commit(self) -> None:
        """The sequence since the last commit becomes the expectation (end of a backward)."""
        if self.seen:
            if self.seen != self.expected:
                self.changes += 1
            self.expected = self.seen
        self.seen = []
        self.pos = 0
