"""The access policy (who may connect, who may manage, priority caps) and the checks of
the socket's directory, without a daemon."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import msgspec
import pytest

from modelpool.protocol.errors import ErrorCode
from modelpool.protocol.messages import (
    Cancel,
    Embed,
    GetStatus,
    LoadModel,
    ReloadConfig,
    StopDaemon,
    UnloadModel,
)
from modelpool.protocol.peers import Peer
from modelpool.supervisor.access import AccessPolicy, ConnectionAccess
from modelpool.supervisor.config import AccessConfig, ConfigError, load_config
from modelpool.supervisor.socket_dir import (
    GROUP_LEAF_MODE,
    LEAF_MODE,
    UnsafeSocketDir,
    bind_unix_socket,
    judge_directory,
    regroup_socket,
    secure_socket_dir,
)

DAEMON = 1000  # the daemon's own uid in these policies
POSTGRES_UID, POSTGRES_GID = 101, 104  # a real second user of this machine (see briefing)


def peer(uid: int, gid: int = 5000, groups: tuple[int, ...] = ()) -> Peer:
    return Peer(pid=4242, uid=uid, gid=gid, groups=(gid, *groups))


def policy(**config: object) -> AccessPolicy:
    return AccessPolicy.from_config(msgspec.convert(config, AccessConfig), DAEMON)


# ---- who may connect -------------------------------------------------------------------


def test_by_default_only_the_daemons_user_and_root_may_connect() -> None:
    p = policy()
    assert p.connection_refusal(peer(DAEMON)) is None
    assert p.connection_refusal(peer(0)) is None
    why = p.connection_refusal(peer(2000))
    assert why is not None and "uid 2000" in why and "allow_users" in why


def test_listed_users_and_members_of_listed_groups_may_connect() -> None:
    p = policy(allow_users=[2000, "postgres"], allow_groups=[7000])
    assert p.connection_refusal(peer(2000)) is None
    assert p.connection_refusal(peer(POSTGRES_UID)) is None  # by name
    assert p.connection_refusal(peer(3000, gid=7000)) is None  # primary group
    assert p.connection_refusal(peer(3001, groups=(7000,))) is None  # supplementary
    assert p.connection_refusal(peer(3002, groups=(7001,))) is not None


def test_admins_may_connect_without_being_listed_again() -> None:
    assert policy(admin_users=[2000]).connection_refusal(peer(2000)) is None


# ---- what they may ask -----------------------------------------------------------------


@pytest.mark.parametrize("msg", [StopDaemon(id=1), LoadModel(id=1, model="m"),
                                 UnloadModel(id=1, model="m"), ReloadConfig(id=1)])
def test_management_commands_are_for_the_daemons_user_root_and_admins(msg: object) -> None:
    p = policy(allow_users=[2000, 2001], admin_users=[2001])
    assert p.request_refusal(peer(DAEMON), msg) is None
    assert p.request_refusal(peer(0), msg) is None
    assert p.request_refusal(peer(2001), msg) is None
    error = p.request_refusal(peer(2000), msg)
    assert error is not None and error.code is ErrorCode.PERMISSION_DENIED and error.id == 1
    assert "uid 2000" in error.message and "admin_users" in error.message


def test_other_requests_are_not_management() -> None:
    p = policy(allow_users=[2000])
    for msg in (GetStatus(id=1), Cancel(id=1), Embed(id=1, texts=["a"])):
        assert p.request_refusal(peer(2000), msg) is None


def test_priority_caps_refuse_what_is_above_them_and_name_the_cap() -> None:
    p = policy(allow_users=[2000, 2001, 2002], max_priority="normal",
               max_priority_for={"2001": "low", "2002": "critical"})
    assert p.priority_cap(peer(2000)) == "normal"
    assert p.priority_cap(peer(2001)) == "low"  # per uid, stricter
    assert p.priority_cap(peer(2002)) is None  # per uid, looser than the default
    assert p.priority_cap(peer(DAEMON)) is None and p.priority_cap(peer(0)) is None
    assert p.request_refusal(peer(2000), Embed(id=3, texts=["a"], priority="normal")) is None
    assert p.request_refusal(peer(2000), Embed(id=3, texts=["a"], priority="batch")) is None
    error = p.request_refusal(peer(2000), Embed(id=3, texts=["a"], priority="high"))
    assert error is not None and error.code is ErrorCode.BAD_REQUEST and error.id == 3
    assert "'normal'" in error.message and "'high'" in error.message
    assert p.request_refusal(peer(2001), Embed(id=4, texts=["a"], priority="normal")) is not None
    assert p.request_refusal(peer(DAEMON), Embed(id=5, texts=["a"], priority="critical")) is None


def test_the_daemons_user_and_root_are_never_refused_and_others_always_checked() -> None:
    """Their connections skip the per-request check; every other connection keeps it."""
    p = policy(allow_users=[2000], max_priority="low")
    for uid in (DAEMON, 0):
        gate = ConnectionAccess(p, peer(uid))
        assert gate.check(StopDaemon(id=1)) is None
        assert gate.check(Embed(id=2, texts=["a"], priority="critical")) is None
    other = ConnectionAccess(p, peer(2000))
    assert other.check(StopDaemon(id=3)) is not None
    assert other.check(Embed(id=4, texts=["a"], priority="normal")) is not None


def test_a_connection_logs_its_refusals_once(caplog: pytest.LogCaptureFixture) -> None:
    gate = ConnectionAccess(policy(allow_users=[2000]), peer(2000))
    with caplog.at_level(logging.WARNING, logger="modelpool.access"):
        for rid in range(50):
            assert gate.check(StopDaemon(id=rid)) is not None
    assert len(caplog.records) == 1 and "uid 2000" in caplog.records[0].getMessage()
    refused = ConnectionAccess(policy(), peer(2000))
    error = refused.refusal()
    assert error is not None and error.code is ErrorCode.PERMISSION_DENIED and error.id is None


def test_socket_group_outside_the_allow_list_is_warned_about() -> None:
    assert policy().unreachable_group_warning(None) is None
    assert "allow_groups" in (policy().unreachable_group_warning("postgres") or "")
    assert policy(allow_groups=["postgres"]).unreachable_group_warning("postgres") is None


def test_config_names_users_and_groups_and_refuses_unknown_ones(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[access]\nallow_users = ["postgres", 2000]\nallow_groups = ["postgres"]\n'
                    'max_priority = "high"\nmax_priority_for = { postgres = "low" }\n')
    config = load_config(path)
    p = AccessPolicy.from_config(config.access, DAEMON)
    assert p.allowed_uids == {POSTGRES_UID, 2000} and p.allowed_gids == {POSTGRES_GID}
    assert p.max_priority_by_uid == {POSTGRES_UID: "low"}
    path.write_text('[access]\nadmin_users = ["no-such-user-here"]\n')
    with pytest.raises(ConfigError, match="no user 'no-such-user-here'"):
        load_config(path)
    path.write_text('[daemon]\nsocket_group = "no-such-group-here"\n')
    with pytest.raises(ConfigError, match="no group 'no-such-group-here'"):
        load_config(path)


# ---- the socket's directory ------------------------------------------------------------


def fake_stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 2, uid, 0, 0, 0, 0, 0))


def test_judging_directories() -> None:
    d = stat.S_IFDIR
    assert judge_directory(fake_stat(d | 0o700, DAEMON), "/x", DAEMON, leaf=True) is None
    assert judge_directory(fake_stat(d | 0o750, DAEMON), "/x", DAEMON, leaf=True) is None
    assert "belongs to uid 2000" in (
        judge_directory(fake_stat(d | 0o700, 2000), "/x", DAEMON, leaf=True) or "")
    assert "belongs to uid 0" in (  # root may own a parent, not the socket's own directory
        judge_directory(fake_stat(d | 0o700, 0), "/x", DAEMON, leaf=True) or "")
    assert judge_directory(fake_stat(d | 0o755, 0), "/x", DAEMON, leaf=False) is None
    assert "writable" in (judge_directory(fake_stat(d | 0o770, DAEMON), "/x", DAEMON,
                                          leaf=True) or "")
    assert "writable" in (judge_directory(fake_stat(d | 0o777, 0), "/x", DAEMON,
                                          leaf=False) or "")
    sticky = d | stat.S_ISVTX | 0o777  # /tmp: others cannot rename what they do not own
    assert judge_directory(fake_stat(sticky, 0), "/tmp", DAEMON, leaf=False) is None
    assert "writable" in (judge_directory(fake_stat(sticky, DAEMON), "/x", DAEMON,
                                          leaf=True) or "")
    assert "not a directory" in (judge_directory(fake_stat(stat.S_IFREG | 0o600, DAEMON),
                                                 "/x", DAEMON, leaf=True) or "")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A directory the test's user owns, mode 0755: a fine parent."""
    tmp_path.chmod(0o755)
    return tmp_path


def test_a_missing_directory_is_made_private(base: Path) -> None:
    assert secure_socket_dir(str(base / "a" / "sock"), None) == []
    assert stat.S_IMODE((base / "a" / "sock").stat().st_mode) == LEAF_MODE
    assert stat.S_IMODE((base / "a").stat().st_mode) == 0o755


def test_with_a_group_the_directory_is_searchable_by_that_group_only(base: Path) -> None:
    assert secure_socket_dir(str(base / "sock"), POSTGRES_GID) == []
    st = (base / "sock").stat()
    assert stat.S_IMODE(st.st_mode) == GROUP_LEAF_MODE and st.st_gid == POSTGRES_GID


def test_an_existing_private_directory_is_kept_and_a_closed_one_warned_about(
        base: Path) -> None:
    (base / "sock").mkdir(mode=0o700)
    assert secure_socket_dir(str(base / "sock"), None) == []
    [warning] = secure_socket_dir(str(base / "sock"), POSTGRES_GID)
    assert "cannot reach" in warning


def modes(*paths: Path) -> list[tuple[int, int]]:
    return [(stat.S_IMODE(p.stat().st_mode), p.stat().st_gid) for p in paths]


def test_a_reloaded_socket_group_opens_and_closes_the_socket_and_the_dir_it_made(
        base: Path) -> None:
    directory, path = base / "sock", base / "sock" / "s.sock"
    bind_unix_socket(str(path), None).close()
    assert modes(directory, path) == [(LEAF_MODE, os.getegid()), (0o600, os.getegid())]
    assert regroup_socket(str(path), str(POSTGRES_GID), made_dir=True) == []
    assert modes(directory, path) == [(GROUP_LEAF_MODE, POSTGRES_GID), (0o660, POSTGRES_GID)]
    assert regroup_socket(str(path), None, made_dir=True) == []
    assert modes(directory, path) == [(LEAF_MODE, os.getegid()), (0o600, os.getegid())]


def test_a_reloaded_socket_group_leaves_a_directory_it_found_and_says_so(base: Path) -> None:
    directory, path = base / "sock", base / "sock" / "s.sock"
    directory.mkdir(mode=0o700)
    bind_unix_socket(str(path), None).close()
    [warning] = regroup_socket(str(path), str(POSTGRES_GID), made_dir=False)
    assert "cannot reach" in warning
    assert modes(directory, path) == [(0o700, os.getegid()), (0o660, POSTGRES_GID)]


def test_a_directory_of_another_user_is_refused(base: Path) -> None:
    theirs = base / "sock"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, POSTGRES_UID, POSTGRES_GID)
    with pytest.raises(UnsafeSocketDir, match="belongs to uid 101 \\(postgres\\)"):
        secure_socket_dir(str(theirs), None)
    assert list(theirs.iterdir()) == []


def test_a_directory_others_can_write_is_refused(base: Path) -> None:
    (base / "sock").mkdir()
    (base / "sock").chmod(0o777)
    with pytest.raises(UnsafeSocketDir, match="writable by"):
        secure_socket_dir(str(base / "sock"), None)


def test_under_a_parent_of_another_user_nothing_is_made(base: Path) -> None:
    theirs = base / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, POSTGRES_UID, POSTGRES_GID)
    with pytest.raises(UnsafeSocketDir, match="theirs belongs to uid 101"):
        secure_socket_dir(str(theirs / "a" / "sock"), None)
    assert list(theirs.iterdir()) == []


def test_a_symlink_of_another_user_is_refused_and_ones_own_followed(base: Path) -> None:
    (base / "real").mkdir(mode=0o700)
    (base / "mine").symlink_to(base / "real")
    assert secure_socket_dir(str(base / "mine"), None) == []
    (base / "planted").symlink_to(base / "real")
    os.chown(base / "planted", POSTGRES_UID, POSTGRES_GID, follow_symlinks=False)
    with pytest.raises(UnsafeSocketDir, match="symlink owned by uid 101"):
        secure_socket_dir(str(base / "planted"), None)
    (base / "elsewhere").symlink_to(base / "theirs")  # ours, to a directory of another user
    (base / "theirs").mkdir(mode=0o700)
    os.chown(base / "theirs", POSTGRES_UID, POSTGRES_GID)
    with pytest.raises(UnsafeSocketDir, match="theirs belongs to uid 101"):
        secure_socket_dir(str(base / "elsewhere"), None)
