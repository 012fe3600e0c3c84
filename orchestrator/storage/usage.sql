-- Token accounting (migration 0030).

-- record_llm_usage --
-- One LLM call's usage (migration 0030), written as soon as the call returned, with the job's
-- tenant, agent and type. Written once per (job, call id): a try repeated after a lost
-- acknowledgement changes nothing. Not fenced by the lease: the tokens were spent whoever holds
-- the job now. Returns whether the row was written.
INSERT INTO orc_llm_usage (job_id, call_id, attempt, tenant_id, agent_id, job_type, model,
                           input_tokens, output_tokens, cache_read_tokens,
                           cache_creation_tokens)
VALUES (%(job_id)s, %(call_id)s, %(attempt)s, %(tenant_id)s, %(agent_id)s, %(job_type)s,
        %(model)s, %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s,
        %(cache_creation_tokens)s)
ON CONFLICT (job_id, call_id) DO NOTHING
RETURNING id

-- set_token_budgets --
-- The token budgets of jobs just submitted (orchestrator.app: only submits that give one run
-- it), in the submit's transaction: a replaced job takes the new budget.
INSERT INTO orc_job_token_budgets (job_id, tokens)
SELECT b.job_id, b.tokens
  FROM unnest(%(job_ids)s::uuid[], %(tokens)s::bigint[]) AS b (job_id, tokens)
ON CONFLICT (job_id) DO UPDATE SET tokens = excluded.tokens

-- token_budget_state --
-- What a budget check reads before an LLM call: the job's own budget (null: none) and the tokens
-- its calls spent (orc_llm_usage's unique (job_id, call_id) index), and, when %(period)s is
-- given ('hour' or 'day'), the tokens the job's tenant spent since the start of the current
-- calendar period in UTC (an index-only range scan of orc_llm_usage_tenant_recorded_at).
SELECT (SELECT b.tokens FROM orc_job_token_budgets AS b WHERE b.job_id = %(job_id)s)
           AS job_budget,
       (SELECT coalesce(sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
                            + u.cache_creation_tokens), 0)
          FROM orc_llm_usage AS u WHERE u.job_id = %(job_id)s)::bigint AS job_spent,
       CASE WHEN %(period)s::text IS NOT NULL THEN
           (SELECT coalesce(sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
                                + u.cache_creation_tokens), 0)
              FROM orc_llm_usage AS u
             WHERE u.tenant_id = %(tenant_id)s
               AND u.recorded_at >= date_trunc(%(period)s, now(), 'UTC'))::bigint
       END AS tenant_spent,
       date_trunc(coalesce(%(period)s, 'day'), now(), 'UTC') AS period_start

-- llm_usage_totals --
-- Calls and tokens over [%(since)s, %(until)s) (either end open when null), grouped by the
-- columns whose by_ flag is set (the others are null in every row), largest first. `tenants`:
-- only theirs (an API principal's), null for any; usage of jobs without a tenant is seen only
-- by a principal of every tenant. A range is read from orc_llm_usage_recorded_at.
SELECT CASE WHEN %(by_job)s THEN u.job_id END AS job_id,
       CASE WHEN %(by_tenant)s THEN u.tenant_id END AS tenant_id,
       CASE WHEN %(by_agent)s THEN u.agent_id END AS agent_id,
       CASE WHEN %(by_model)s THEN u.model END AS model,
       CASE WHEN %(by_job_type)s THEN u.job_type END AS job_type,
       count(*) AS calls,
       sum(u.input_tokens)::bigint AS input_tokens,
       sum(u.output_tokens)::bigint AS output_tokens,
       sum(u.cache_read_tokens)::bigint AS cache_read_tokens,
       sum(u.cache_creation_tokens)::bigint AS cache_creation_tokens
  FROM orc_llm_usage AS u
 WHERE u.recorded_at >= coalesce(%(since)s::timestamptz, '-infinity')
   AND u.recorded_at < coalesce(%(until)s::timestamptz, 'infinity')
   AND (%(tenants)s::text[] IS NULL OR u.tenant_id = ANY (%(tenants)s))
   AND (%(tenant_id)s::text IS NULL OR u.tenant_id = %(tenant_id)s)
   AND (%(agent_id)s::text IS NULL OR u.agent_id = %(agent_id)s)
   AND (%(model)s::text IS NULL OR u.model = %(model)s)
   AND (%(job_type)s::text IS NULL OR u.job_type = %(job_type)s)
   AND (%(job_id)s::uuid IS NULL OR u.job_id = %(job_id)s)
 GROUP BY 1, 2, 3, 4, 5
 ORDER BY sum(u.input_tokens + u.output_tokens + u.cache_read_tokens
              + u.cache_creation_tokens) DESC, 1, 2, 3, 4, 5
 LIMIT %(limit)s

-- job_llm_usage --
-- A job's LLM calls in the order they were recorded, and its token budget (one row per call; a
-- job without calls gives one row of nulls but its budget).
SELECT b.tokens AS token_budget, u.call_id, u.attempt, u.model, u.input_tokens,
       u.output_tokens, u.cache_read_tokens, u.cache_creation_tokens, u.recorded_at
  FROM (SELECT %(job_id)s::uuid AS job_id) AS j
  LEFT JOIN orc_job_token_budgets AS b ON b.job_id = j.job_id
  LEFT JOIN orc_llm_usage AS u ON u.job_id = j.job_id
 ORDER BY u.id

-- descendants_llm_usage --
-- The LLM usage of the jobs below a job in the tree its steps spawned (children, theirs, and so
-- on; failed and cancelled ones too): how many jobs, calls and tokens of each kind.
WITH RECURSIVE below (id) AS (
    SELECT k.child_id FROM orc_job_children AS k WHERE k.parent_id = %(job_id)s
    UNION
    SELECT k.child_id FROM orc_job_children AS k JOIN below AS b ON k.parent_id = b.id
)
SELECT (SELECT count(*) FROM below) AS jobs, count(u.id) AS calls,
       coalesce(sum(u.input_tokens), 0) AS input_tokens,
       coalesce(sum(u.output_tokens), 0) AS output_tokens,
       coalesce(sum(u.cache_read_tokens), 0) AS cache_read_tokens,
       coalesce(sum(u.cache_creation_tokens), 0) AS cache_creation_tokens
  FROM below AS b
  JOIN orc_llm_usage AS u ON u.job_id = b.id
