-- Schedules (orchestrator.services.scheduler; migration 0027).

-- sync_schedules --
-- An application's schedules ([{name, job_type, cron, tz, tenant_id, backfill_seconds}]),
-- written where new or changed after its declaration (orc_declare_v1), in its transaction; a
-- new one's ticks are due from now on. `gone`: those it withdrew that no other application
-- declares. In name order, so processes starting together take the rows' locks in one order.
WITH gone AS (
    DELETE FROM orc_schedules WHERE name = ANY (%(gone)s::text[])
)
INSERT INTO orc_schedules AS s (name, job_type, cron, tz, tenant_id, backfill_seconds)
SELECT d.name, d.job_type, d.cron, d.tz, d.tenant_id, d.backfill_seconds
  FROM jsonb_to_recordset(%(schedules)s) AS d(name text, job_type text, cron text, tz text,
                                              tenant_id text, backfill_seconds integer)
 ORDER BY d.name
    ON CONFLICT (name) DO UPDATE
   SET job_type = excluded.job_type, cron = excluded.cron, tz = excluded.tz,
       tenant_id = excluded.tenant_id, backfill_seconds = excluded.backfill_seconds,
       defined_at = now()
 WHERE (s.job_type, s.cron, s.tz, s.tenant_id, s.backfill_seconds)
       IS DISTINCT FROM (excluded.job_type, excluded.cron, excluded.tz, excluded.tenant_id,
                         excluded.backfill_seconds)

-- schedules_to_fire --
-- The scheduler's one read per check: where each of its schedules stands, and the database's
-- clock, which every process reads ticks by.
SELECT name, fire_after, paused_at IS NOT NULL AS paused, statement_timestamp() AS now
  FROM orc_schedules
 WHERE name = ANY (%(names)s)
 ORDER BY name

-- fire_schedule --
-- The compare-and-set of a firing: the schedule moves past its last fired tick only if no other
-- process moved it since `seen` was read (nor paused it); no row: nothing to submit.
UPDATE orc_schedules
   SET fire_after = %(tick)s, last_tick = %(tick)s, last_job_id = %(job_id)s
 WHERE name = %(name)s AND fire_after = %(seen)s AND paused_at IS NULL
RETURNING name

-- schedule_last_job --
-- The job a firing's last run is, when its submit answered with another job than the one it
-- made: a job holding the tick's key already (one written before submits were refused the
-- schedules' keys, or by SQL), which the tick's deduplicating submit returned.
UPDATE orc_schedules SET last_job_id = %(job_id)s WHERE name = %(name)s

-- list_schedules --
-- `tenants`: only theirs (an API principal's), null for any; a schedule without a tenant is
-- seen only by a principal of every tenant.
SELECT *, statement_timestamp() AS now FROM orc_schedules
 WHERE (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
 ORDER BY name

-- pause_schedule --
-- Held until resumed; pausing a paused schedule keeps who paused it first.
UPDATE orc_schedules
   SET paused_at = coalesce(paused_at, now()), paused_by = coalesce(paused_by, %(by)s)
 WHERE name = %(name)s AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
RETURNING *, statement_timestamp() AS now

-- resume_schedule --
-- Its ticks are due again from now on: those it missed while paused never run.
UPDATE orc_schedules
   SET fire_after = CASE WHEN paused_at IS NULL THEN fire_after
                         ELSE greatest(fire_after, now()) END,
       paused_at = NULL, paused_by = NULL
 WHERE name = %(name)s AND (%(tenants)s::text[] IS NULL OR tenant_id = ANY (%(tenants)s))
RETURNING *, statement_timestamp() AS now
