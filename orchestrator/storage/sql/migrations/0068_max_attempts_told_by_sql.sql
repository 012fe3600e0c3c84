-- 0068_max_attempts_told_by_sql: the worker contract's max_attempts has one production home, SQL
-- (functions/claim.sql; Python keeps only the tests' model, tests/support/attempts.py). The claim
-- returns it (most_attempts: orc_max_attempts_v1, as in its job.running), for an external
-- worker's claim answer; every statement writing a failure stamps it into job.failed,
-- job.retry_scheduled and last_error from the job's row (orc_max_attempts_after_v1: a retry's,
-- the claim it leads to; a terminal failure's, the attempt), as it stamps available_at and
-- dead_letter_id. Payloads are unchanged.
--
-- The claim's row grows a column, so orc_claim_v1 and orc_claim_v2 are made anew (claim.sql):
-- the release before reads claims as rows or JSON into a model that ignores a column it does not
-- know. Its failures bring their own max_attempts: its retries are its own statements, which
-- keep theirs; its terminal failures go through orc_fail_jobs_v1, which replaces theirs with
-- the same value (the attempt).
--
-- compatible-with-older-workers: yes
-- revises: functions/claim.sql dadd5eaf19c5cc1a753a0dee2e5036ee511e81093e1cf083acf43f6901c19300
-- revises: functions/outcomes.sql d471502cedb18303da8c7e697ccf675b4a7dae62fb6a914dce0f48cdf392abbc

DROP FUNCTION IF EXISTS orc_claim_v2(uuid, bigint, integer, text, text[], text, text);
DROP FUNCTION IF EXISTS orc_claim_v1(uuid, bigint, integer, text, text[], text);
