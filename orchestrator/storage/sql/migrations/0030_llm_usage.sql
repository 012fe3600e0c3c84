-- 0030_llm_usage: what each LLM call of a job spent, and the token budgets of jobs.
--
-- compatible-with-older-workers: yes
--
-- orc_llm_usage: one row per LLM call a job's attempt made and that returned, as the provider
-- counted its tokens (input, output, cache read, cache write), written by the attempt as soon as
-- the call returns (JobContext.record_llm_usage), in a statement of its own: the tokens were
-- spent whatever the attempt does next, so the row stays when the attempt later fails, is
-- retried or is superseded. (job_id, call_id) is unique: the call's id (the provider's message
-- id) is written once however often the write is tried. The job's tenant, agent and type are
-- copied in, so totals over a time range group without reading orc_jobs. A job pruned by
-- retention takes its rows with it (the cascade); see docs/configuration.md, "Token accounting
-- and budgets".
--
-- orc_job_token_budgets: the optional token budget of a job (the submit's token_budget), one row
-- per job that has one, going with its job (the cascade). Kept apart from orc_jobs so that the
-- submit of a job without a budget, and every status change, write exactly what they wrote.
--
-- Indexes: (job_id, call_id) (the uniqueness; a job's usage and the cascade read it),
-- (recorded_at) for totals over a time range and the fleet exporter's recent window, and
-- (tenant_id, recorded_at) with the token counts included, for a tenant's budget check: an
-- index-only range scan of the tenant's calls in the current period.
--
-- orc_job_rollups gains the LLM calls and tokens of the jobs each row counts (0026's rollups:
-- a job's usage is counted in the minute it finished, with its outcome), so token totals by job
-- type, queue and tenant outlive the usage rows that retention deletes with their jobs (it
-- deletes only jobs the rollups have counted). Added with a constant default: no rewrite of the
-- table; rows rolled up before this migration count no tokens.
--
-- Compatible with older workers: new tables, which no older release reads or writes, and new
-- columns with defaults, which the older rollup statement leaves alone.

CREATE TABLE orc_llm_usage (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id uuid NOT NULL REFERENCES orc_jobs (id) ON DELETE CASCADE,
    call_id text NOT NULL CHECK (length(call_id) BETWEEN 1 AND 200),
    attempt integer NOT NULL,
    tenant_id text,
    agent_id text,
    job_type text NOT NULL,
    model text NOT NULL CHECK (length(model) BETWEEN 1 AND 200),
    input_tokens bigint NOT NULL CHECK (input_tokens >= 0),
    output_tokens bigint NOT NULL CHECK (output_tokens >= 0),
    cache_read_tokens bigint NOT NULL CHECK (cache_read_tokens >= 0),
    cache_creation_tokens bigint NOT NULL CHECK (cache_creation_tokens >= 0),
    recorded_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (job_id, call_id)
);
CREATE INDEX orc_llm_usage_recorded_at ON orc_llm_usage (recorded_at);
CREATE INDEX orc_llm_usage_tenant_recorded_at ON orc_llm_usage (tenant_id, recorded_at)
    INCLUDE (input_tokens, output_tokens, cache_read_tokens, cache_creation_tokens)
    WHERE tenant_id IS NOT NULL;

CREATE TABLE orc_job_token_budgets (
    job_id uuid PRIMARY KEY REFERENCES orc_jobs (id) ON DELETE CASCADE,
    tokens bigint NOT NULL CHECK (tokens > 0)
);

ALTER TABLE orc_job_rollups
    ADD COLUMN llm_calls bigint NOT NULL DEFAULT 0,
    ADD COLUMN input_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_read_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_creation_tokens bigint NOT NULL DEFAULT 0;
