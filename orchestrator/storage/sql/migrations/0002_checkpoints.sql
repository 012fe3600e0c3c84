-- 0002_checkpoints: durable agent steps, the side-effect ledger, and approval gates.
--
-- A step's checkpoint is its commit point: written in one statement with the results of the
-- side effects the step made, fenced by the attempt's lease. A side effect is recorded pending
-- before its call; once committed it is never executed again.

CREATE TABLE orc_checkpoints (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    step integer NOT NULL CHECK (step >= 1),
    state jsonb NOT NULL,
    final boolean NOT NULL DEFAULT false,  -- the job's last step: nothing follows it
    attempt integer NOT NULL,          -- the attempt that wrote it
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step)
);

CREATE TABLE orc_side_effects (
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    invocation_id text NOT NULL,       -- <job id>.<step>.<key>: passed to the external call
    step integer NOT NULL CHECK (step >= 1),
    name text NOT NULL,
    args jsonb NOT NULL,
    status text NOT NULL CHECK (status IN ('pending', 'committed', 'failed')),
    result jsonb,
    error jsonb,
    attempt integer NOT NULL,          -- the attempt that last recorded or committed it
    reconciled boolean NOT NULL DEFAULT false,  -- committed from reconcile(), not from a call
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, invocation_id),
    CONSTRAINT orc_side_effects_result_iff_committed
        CHECK ((status = 'committed') = (result IS NOT NULL))
);

-- A committed side effect is history: nothing may make it pending, failed or different again.
CREATE FUNCTION orc_side_effect_committed_is_final_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.status = 'committed' THEN
        RAISE EXCEPTION 'side effect % of job % is committed and cannot change',
            OLD.invocation_id, OLD.job_id
            USING ERRCODE = 'WF003';
    END IF;
    NEW.updated_at := now();
    RETURN NEW;
END;
$$;

CREATE TRIGGER orc_side_effects_committed_is_final
    BEFORE UPDATE ON orc_side_effects
    FOR EACH ROW EXECUTE FUNCTION orc_side_effect_committed_is_final_v1();

CREATE TABLE orc_approvals (
    id uuid PRIMARY KEY,
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    step integer NOT NULL,
    key text NOT NULL,
    question text NOT NULL,
    details jsonb NOT NULL DEFAULT '{}',
    on_reject text NOT NULL CHECK (on_reject IN ('fail', 'resume')),
    status text NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'approved', 'rejected', 'expired', 'cancelled')),
    requested_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    decided_at timestamptz,
    decided_by text,
    reason text,
    UNIQUE (job_id, step, key),
    CONSTRAINT orc_approvals_decided CHECK ((status = 'pending') = (decided_at IS NULL))
);
CREATE INDEX orc_approvals_pending_expiry ON orc_approvals (expires_at) WHERE status = 'pending';
