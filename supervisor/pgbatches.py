"""The statements that every job runs through, each written for many jobs at once (their
fields as arrays, unnested into rows), for the group commits of PgJobs: the INSERT that
writes submitted jobs (and claims those this node can start at once), the UPDATE that
stores results, and the read of records.
"""

from __future__ import annotations

from typing import Any

from modelpool.supervisor.mailbox import JobRecord
from modelpool.supervisor.queueing import PRIORITY_RANK

T = "modelpool.jobs"
COLUMNS = ("key, uid, op, model, priority, request, single, submitted_at, state, started_at, "
           "finished_at, node, result, error_code, error_message, attempt, stream_to")

# Claimed at once (the caller can start it, and nothing of its model and variant waits at
# its priority or above: priorities hold across nodes) a job wakes no other node; queued, it
# wakes them all. Identical work joins the job already waiting or running, or the first
# of its batch (`joins`). The bound on waiting jobs, and each user's and tenant's share of
# it (owners.share_of), are checked against what waits before the batch.
INSERT = f"""
    WITH batch AS (
        SELECT * FROM unnest(%(keys)s::text[], %(uids)s::int[], %(ops)s::text[],
            %(models)s::text[], %(priorities)s::smallint[], %(requests)s::bytea[],
            %(singles)s::boolean[], %(dedups)s::bytea[], %(submitted)s::float8[],
            %(claims)s::boolean[], %(joins)s::text[], %(deadlines)s::float8[],
            %(variants)s::text[], %(streams)s::text[], %(tenants)s::text[])
        AS b(key, uid, op, model, priority, request, single, dedup, submitted_at, claim,
             joins, deadline_in, variant, stream_to, tenant)),
    fated AS MATERIALIZED (
        SELECT b.*, coalesce(lead.key, b.joins) AS leader, CASE
            WHEN coalesce(lead.key, b.joins) IS NOT NULL THEN 'joined'
            WHEN b.claim AND NOT EXISTS (
                SELECT 1 FROM {T} WHERE state = 'queued' AND model = b.model
                    AND priority <= b.priority
                    AND (variant IS NULL OR variant = b.variant)) THEN 'running'
            ELSE 'queued' END AS fate
        FROM batch b LEFT JOIN LATERAL (
            SELECT key FROM {T} WHERE b.dedup IS NOT NULL AND dedup = b.dedup
                AND state IN ('queued', 'running') AND leader IS NULL LIMIT 1) lead ON true
        WHERE (SELECT count(*) FROM {T} WHERE state = 'queued') < %(max_queued)s
            AND (SELECT count(*) FROM {T} WHERE state = 'queued' AND uid = b.uid)
                < %(user_share)s
            AND (b.tenant = '' OR (SELECT count(*) FROM {T} WHERE state = 'queued'
                AND uid = b.uid AND tenant = b.tenant) < %(tenant_share)s)),
    added AS (
        INSERT INTO {T} (key, uid, op, model, priority, request, single, dedup, leader,
                         submitted_at, state, node, attempt, lease_until, started_at,
                         deadline_at, variant, stream_to, tenant)
        SELECT key, uid, op, model, priority, request, single, dedup, leader, submitted_at,
               fate, CASE WHEN fate = 'running' THEN %(node)s ELSE '' END,
               CASE WHEN fate = 'running' THEN 1 ELSE 0 END,
               CASE WHEN fate = 'running' THEN now() + make_interval(secs => %(lease)s) END,
               CASE WHEN fate = 'running' THEN submitted_at END,
               now() + make_interval(secs => deadline_in),  -- the server clock
               variant, stream_to, tenant
        FROM fated
        RETURNING key, state, model),
    woken AS (
        SELECT pg_notify('modelpool_jobs', model)
        FROM (SELECT DISTINCT model FROM added WHERE state <> 'running') AS waiting)
    SELECT key, state, (SELECT count(*) FROM woken) AS woken  -- named, so that it runs
    FROM added"""

# Only the node holding a job's current claim (node, attempt) stores its result: the
# first completion wins. The jobs that joined it get the same ending; those of a
# cancelled job go back to the queue to run on their own.
FINISH = f"""
    WITH batch AS (
        SELECT * FROM unnest(%(keys)s::text[], %(states)s::text[], %(results)s::bytea[],
            %(codes)s::text[], %(messages)s::text[], %(at)s::float8[], %(attempts)s::int[])
        AS b(key, state, result, code, message, at, attempt)),
    done AS (
        UPDATE {T} AS j SET state = b.state, result = b.result, error_code = b.code,
            error_message = b.message, finished_at = b.at, lease_until = NULL,
            expires_at = now() + make_interval(secs => %(keep)s)
        FROM batch b
        WHERE j.key = ANY(%(keys)s::text[])  -- found by key, whatever else is running
            AND j.key = b.key AND j.state = 'running' AND j.node = %(node)s
            AND j.attempt = b.attempt
        RETURNING j.key),
    joiners AS (
        UPDATE {T} AS j SET
            state = CASE WHEN b.state = 'cancelled' THEN 'queued' ELSE b.state END,
            leader = CASE WHEN b.state = 'cancelled' THEN NULL ELSE j.leader END,
            result = b.result, error_code = b.code, error_message = b.message,
            finished_at = CASE WHEN b.state = 'cancelled' THEN NULL ELSE b.at END,
            expires_at = CASE WHEN b.state = 'cancelled' THEN NULL
                              ELSE now() + make_interval(secs => %(keep)s) END
        FROM batch b
        WHERE j.leader = b.key AND j.state = 'joined' AND b.key IN (SELECT key FROM done)
        RETURNING j.key, j.state)
    SELECT pg_notify(CASE WHEN state = 'queued' THEN 'modelpool_jobs'
                          ELSE 'modelpool_done' END, key), key, leads
        FROM (SELECT key, 'ended' AS state, true AS leads FROM done
              UNION ALL SELECT key, state, false FROM joiners) AS ended"""

READ = f"SELECT {COLUMNS} FROM {T} WHERE key = ANY(%s)"


def insert_params(records: list[tuple[JobRecord, bool]]) -> dict[str, Any]:
    """The arrays of INSERT for (record, claim) pairs; identical work later in the batch
    joins the first of it."""
    first: dict[bytes, str] = {}
    joins = []
    for record, _ in records:
        if record.dedup is None:
            joins.append(None)
        else:
            joins.append(first.get(record.dedup))
            first.setdefault(record.dedup, record.key)
    rows = [record for record, _ in records]
    return {
        "keys": [r.key for r in rows], "uids": [r.uid for r in rows],
        "ops": [r.op for r in rows], "models": [r.model for r in rows],
        "priorities": [PRIORITY_RANK[r.priority] for r in rows],  # type: ignore[index]
        "requests": [r.request for r in rows], "singles": [r.single for r in rows],
        "dedups": [r.dedup for r in rows], "submitted": [r.submitted_at for r in rows],
        "claims": [claim for _, claim in records], "joins": joins,
        "deadlines": [None if r.deadline_at is None else r.deadline_at - r.submitted_at
                      for r in rows],
        "variants": [r.variant for r in rows], "streams": [r.stream_to for r in rows],
        "tenants": [r.tenant for r in rows],
    }


def finish_params(outcomes: list[tuple[JobRecord, int]]) -> dict[str, Any]:
    """The arrays of FINISH for (outcome, attempt) pairs."""
    rows = [outcome for outcome, _ in outcomes]
    return {
        "keys": [r.key for r in rows], "states": [r.state for r in rows],
        "results": [r.result for r in rows], "codes": [r.error_code for r in rows],
        "messages": [r.error_message for r in rows], "at": [r.finished_at for r in rows],
        "attempts": [attempt for _, attempt in outcomes],
    }
