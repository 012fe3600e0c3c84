-- 0019_api: what `orchestrator serve` (the HTTP API, docs/api.md) keeps in the database.
--
-- * orc_api_tokens: one row per API token. The token's secret is never stored, only its
--   SHA-256 (a token is `orc_<id>_<secret>`, 256 random bits: a fast hash is enough, as for
--   GitHub's and Stripe's keys). `scopes` are what it may do; `tenants` null: every tenant's
--   jobs, else only those tenants' (and no job without a tenant). Revoked tokens stay, for the
--   record of who acted.
-- * orc_event_listeners: the API servers that wait for a job's events right now (a long-poll
--   for an outcome, an event stream), each with the time its claim lapses unless renewed.
--   While one is listed, every statement that appends to orc_job_events sends one NOTIFY on
--   `orc_job_events` (empty payload: the listener reads what is new from the events' ids). With
--   none listed, the trigger costs one look at this (near-empty) table per statement: workers
--   pay for notifications only while somebody waits for them.

CREATE TABLE orc_api_tokens (
    id uuid PRIMARY KEY,
    name text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 100),
    secret_sha256 bytea NOT NULL CHECK (length(secret_sha256) = 32),
    scopes text[] NOT NULL
        CHECK (cardinality(scopes) > 0
               AND scopes <@ ARRAY['read', 'submit', 'operate', 'worker', 'admin']),
    tenants text[] CHECK (tenants IS NULL OR cardinality(tenants) > 0),
    created_by text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    revoked_at timestamptz
);

CREATE TABLE orc_event_listeners (
    listener text PRIMARY KEY,
    until timestamptz NOT NULL
);

CREATE FUNCTION orc_notify_event_listeners_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT FROM orc_event_listeners WHERE until > now()) THEN
        PERFORM pg_notify('orc_job_events', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER orc_job_events_notify
    AFTER INSERT ON orc_job_events
    FOR EACH STATEMENT EXECUTE FUNCTION orc_notify_event_listeners_v1();

-- External job types (run by workers in any language over the API, docs/api.md) have queues of
-- their own, which in-process workers must not take, even when they take "every queue". The
-- fetch gains a list of queues to leave alone. With none (no external job type: the usual
-- case) it is Procrastinate's own fetch, as before; with some, it is Procrastinate's fetch query
-- (procrastinate_fetch_job_v2 of Procrastinate 3.10, its lock, priority and schedule rules)
-- with that one condition more. The claim is as in orc_fetch_dispatch_v1 (0014).
CREATE FUNCTION orc_fetch_dispatch_v2(
    p_queues character varying[], p_excluded character varying[], p_worker_id bigint,
    p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
    job uuid;
    claim jsonb;
BEGIN
    IF coalesce(cardinality(p_excluded), 0) = 0 THEN
        fetched := procrastinate_fetch_job_v2(p_queues, p_worker_id);
    ELSE
        WITH candidate AS (
            SELECT jobs.*
              FROM procrastinate_jobs AS jobs
             WHERE NOT EXISTS (
                       SELECT 1
                         FROM procrastinate_jobs AS other_jobs
                        WHERE jobs.lock IS NOT NULL
                          AND other_jobs.lock = jobs.lock
                          AND (other_jobs.status = 'doing'
                               OR (other_jobs.status = 'todo'
                                   AND (other_jobs.priority > jobs.priority
                                        OR (other_jobs.priority = jobs.priority
                                            AND other_jobs.id < jobs.id)))))
               AND jobs.status = 'todo'
               AND (p_queues IS NULL OR jobs.queue_name = ANY (p_queues))
               AND jobs.queue_name <> ALL (p_excluded)
               AND (jobs.scheduled_at IS NULL OR jobs.scheduled_at <= now())
             ORDER BY jobs.priority DESC, jobs.id ASC
             LIMIT 1
               FOR UPDATE OF jobs SKIP LOCKED
        )
        UPDATE procrastinate_jobs
           SET status = 'doing', worker_id = p_worker_id
          FROM candidate
         WHERE procrastinate_jobs.id = candidate.id
        RETURNING procrastinate_jobs.* INTO fetched;
    END IF;
    IF fetched.id IS NOT NULL AND starts_with(fetched.task_name, p_task_prefix) THEN
        job := (fetched.args ->> 'job_id')::uuid;
        PERFORM FROM orc_jobs AS j WHERE j.id = job FOR NO KEY UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT FROM orc_jobs AS j WHERE j.id = job) THEN
            fetched.args := fetched.args || '{"claim": null, "claim_later": true}';
        ELSE
            SELECT to_jsonb(c) INTO claim
              FROM orc_claim_v1(job, fetched.id, fetched.attempts + 1,
                                p_worker || '/w' || p_worker_id, p_claimable, p_running) AS c;
            fetched.args := fetched.args || jsonb_build_object('claim', claim);
        END IF;
    END IF;
    RETURN NEXT fetched;
END;
$$;

CREATE FUNCTION orc_fetch_dispatches_v2(
    p_limit integer, p_queues character varying[], p_excluded character varying[],
    p_worker_id bigint, p_task_prefix text, p_worker text, p_claimable text[], p_running text
) RETURNS SETOF procrastinate_jobs
LANGUAGE plpgsql AS $$
DECLARE
    fetched procrastinate_jobs;
BEGIN
    FOR i IN 1 .. p_limit LOOP
        SELECT * INTO fetched
          FROM orc_fetch_dispatch_v2(p_queues, p_excluded, p_worker_id, p_task_prefix, p_worker,
                                     p_claimable, p_running);
        EXIT WHEN fetched.id IS NULL;
        RETURN NEXT fetched;
    END LOOP;
END;
$$;
