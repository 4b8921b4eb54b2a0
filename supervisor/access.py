"""Who may use the daemon, and what they may ask: the front door's policy.

The kernel tells the daemon who each client is (SO_PEERCRED, protocol/peers.py). The
daemon's own user and root may do anything. Other users may connect only if `[access]`
lists them (allow_users, admin_users) or one of their groups (allow_groups); they may
stop the daemon, load and unload models only if listed in admin_users; and their work
requests may ask for at most their priority cap (max_priority, max_priority_for).

The policy is pure (AccessPolicy and its methods); ConnectionAccess applies it to one
connection and logs a refusal once per connection, never once per frame.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.fields import PRIORITIES, Priority
from modelpool.protocol.jobs import Submit
from modelpool.protocol.kinds import KIND_OF
from modelpool.protocol.messages import Error, LoadModel, ReloadConfig, StopDaemon, UnloadModel
from modelpool.protocol.peers import Peer, uid_of, user_name
from modelpool.supervisor.config import AccessConfig, gid_of

log = logging.getLogger("modelpool.access")

ADMIN_ONLY: Mapping[type, str] = {StopDaemon: "stop", LoadModel: "load", UnloadModel: "unload",
                                  ReloadConfig: "reload"}
REFUSED_HELLO_BYTES = 64 * 1024  # read at most this much of a refused client's hello ...
REFUSED_HELLO_S = 1.0  # ... for at most this long, so that its reply is the refusal


@dataclass(frozen=True)
class AccessPolicy:
    """The `[access]` config with names resolved, for a daemon running as daemon_uid."""

    daemon_uid: int
    allowed_uids: frozenset[int] = frozenset()
    allowed_gids: frozenset[int] = frozenset()
    admin_uids: frozenset[int] = frozenset()
    max_priority: Priority = "critical"
    max_priority_by_uid: Mapping[int, Priority] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: AccessConfig, daemon_uid: int) -> AccessPolicy:
        return cls(daemon_uid=daemon_uid,
                   allowed_uids=frozenset(uid_of(u) for u in config.allow_users),
                   allowed_gids=frozenset(gid_of(g) for g in config.allow_groups),
                   admin_uids=frozenset(uid_of(u) for u in config.admin_users),
                   max_priority=config.max_priority,
                   max_priority_by_uid={uid_of(u): p
                                        for u, p in config.max_priority_for.items()})

    def is_owner(self, peer: Peer) -> bool:
        """The daemon's own user or root: never refused, never capped."""
        return peer.uid in (self.daemon_uid, 0)

    def is_admin(self, peer: Peer) -> bool:
        return self.is_owner(peer) or peer.uid in self.admin_uids

    def connection_refusal(self, peer: Peer) -> str | None:
        """Why peer may not connect; None if it may."""
        if self.is_admin(peer) or peer.uid in self.allowed_uids:
            return None
        if self.allowed_gids.intersection(peer.groups or (peer.gid,)):
            return None
        return (f"{user_name(peer.uid)} may not use this daemon (it runs as "
                f"{user_name(self.daemon_uid)}); its [access] allow_users or allow_groups "
                f"must name you")

    def priority_cap(self, peer: Peer) -> Priority | None:
        """The highest priority peer may ask for; None: no cap."""
        if self.is_owner(peer):
            return None
        cap = self.max_priority_by_uid.get(peer.uid, self.max_priority)
        return None if cap == PRIORITIES[0] else cap

    def request_refusal(self, peer: Peer, msg: Any) -> Error | None:
        """The error answering msg from peer, if the policy refuses it; None if not."""
        if (command := ADMIN_ONLY.get(type(msg))) is not None:
            if self.is_admin(peer):
                return None
            return Error(id=msg.id, code=ErrorCode.PERMISSION_DENIED,
                         message=f"`{command}` is only for the daemon's user "
                                 f"({user_name(self.daemon_uid)}), root and [access] "
                                 f"admin_users; you are {user_name(peer.uid)}")
        request = msg.request if isinstance(msg, Submit) else msg  # a job asks the same
        cap = self.priority_cap(peer) if type(request) in KIND_OF else None
        if cap is not None and PRIORITIES.index(request.priority) < PRIORITIES.index(cap):
            return Error(id=msg.id, code=ErrorCode.BAD_REQUEST,
                         message=f"priority {request.priority!r} is above the highest allowed "
                                 f"for {user_name(peer.uid)}: {cap!r}")
        return None

    def unreachable_group_warning(self, socket_group: str | None) -> str | None:
        """socket_group lets a group reach the socket, but the policy only admits the
        users it names: say so at start rather than surprise the group's members."""
        if socket_group is None or gid_of(socket_group) in self.allowed_gids:
            return None
        return (f"socket_group {socket_group!r} can reach the socket, but only users "
                f"[access] allows may use it: add allow_groups = [{socket_group!r}] to "
                f"admit the whole group")


class ConnectionAccess:
    """The policy applied to one connection's peer; refusals are logged once."""

    def __init__(self, policy: AccessPolicy, peer: Peer) -> None:
        self.policy = policy
        self.peer = peer
        self.logged = False
        self.unrestricted = policy.is_owner(peer)  # nothing to check on each request

    def refusal(self) -> Error | None:
        """The error turning this connection away, or None if it may proceed."""
        why = self.policy.connection_refusal(self.peer)
        if why is None:
            return None
        self._log(f"refused a connection: {why}")
        return Error(id=None, code=ErrorCode.PERMISSION_DENIED, message=why)

    def check(self, msg: Any) -> Error | None:
        """The error answering msg, if the policy refuses it."""
        if self.unrestricted:
            return None
        error = self.policy.request_refusal(self.peer, msg)
        if error is not None:
            self._log(f"refused {type(msg).__name__}: {error.message} (further refusals on "
                      f"this connection are not logged)")
        return error

    def _log(self, message: str) -> None:
        if not self.logged:
            self.logged = True
            log.warning("pid %d, %s: %s", self.peer.pid, user_name(self.peer.uid), message)
