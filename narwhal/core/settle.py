"""When a watched file's change is read: once it has stood still for one check.

A file rewritten in place (truncated, then written) can be seen half-way: empty, or a
shorter list. For the keys file an empty file is valid and revokes every key; for
discovery.file an empty list is valid and every engine leaves. Either, read in that
window, took everything away until the next check. So a change is taken only when the
stamp (size, modification time, inode, device) that announced it is still the stamp
one check later; a change takes one check interval more to apply, and a file rewritten
at every check is read once it stops changing. Used by narwhal/tenants/keys.py and
narwhal/fleet/file.py; sans-IO: the caller stats the file and passes the stamp.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Settle"]


class Settle:
    """`stamp`: what was last taken; `settling`: a new stamp seen once, not yet taken."""

    __slots__ = ("stamp", "settling")

    def __init__(self, stamp: Hashable | None = None) -> None:
        self.stamp = stamp
        self.settling: Hashable | None = None

    def changed(self, stamp: Hashable) -> bool:
        """True once per change, at the check after the one that first saw it, if the
        file has not changed again in between (then that newer stamp settles instead)."""
        if stamp == self.stamp:
            self.settling = None
            return False
        if stamp != self.settling:
            self.settling = stamp
            return False
        self.stamp, self.settling = stamp, None
        return True

    @property
    def quiet(self) -> Hashable | None:
        """The stamp taken while no newer one settles, else None: a check may answer
        "unchanged" from the file's stat against it (narwhal/config.py WatchedFile.read),
        never while a change settles (that one is read whole until it is taken)."""
        return self.stamp if self.settling is None else None
