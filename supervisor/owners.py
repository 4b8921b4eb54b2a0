"""Who takes turns in the queues: users (peer uids), then each user's owners.

An owner is a connection (uid, serial), a user's submitted jobs (uid, "jobs"), or a
tenant its requests name within their user (the HTTP front door names each API key's),
whichever connection or job carries them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple


class Tenant(NamedTuple):
    """An owner named by its requests' `tenant`, within the user that sent them."""

    uid: Hashable
    name: str


def user_of(owner: Hashable) -> Hashable:
    """The user an owner belongs to; any owner that is not a tuple (a test's name) is a
    user of its own."""
    return owner[0] if isinstance(owner, tuple) and owner else owner


def owner_of(sink_owner: Hashable, tenant: str) -> Hashable:
    """Whose turn a request takes among its user's clients: its sink's (connection, or
    its user's jobs), or its tenant's. A tenant is named within its user, so naming one
    takes no turn, and no share of a queue, from other users."""
    if not tenant or not isinstance(sink_owner, tuple):
        return sink_owner
    return Tenant(user_of(sink_owner), tenant)


def share_of(limit: int) -> int:
    """What one holder may take of a bound it shares with others: all but its last
    quarter, which is kept for them (at least one)."""
    return max(1, limit - limit // 4)
