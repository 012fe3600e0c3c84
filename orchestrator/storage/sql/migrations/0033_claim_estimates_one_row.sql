-- 0033_claim_estimates_one_row: the claim is planned as the one-row function it is.
--
-- compatible-with-older-workers: yes
--
-- orc_fetch_dispatch_v3 (migration 0029) reads its claim as
-- `FROM orc_claim_v1(...) AS c JOIN orc_jobs AS o ON o.id = c.id`. A set-returning function
-- without a ROWS estimate is planned for 1,000 rows, and against a job table of a few
-- thousand rows or more the planner answered with a hash join over a sequential scan of the
-- whole table, on every claim: the fetch's cost grew with the table (16 ms per claim at 35,000
-- jobs; the no-op drain fell from 1,621 to 166 jobs/s). Each of these functions returns at most
-- one row, and says so now, so the join is an index lookup of that one job.
--
-- Compatible with older workers: only the planner's estimate changes, not a signature or a
-- result.

ALTER FUNCTION orc_claim_v1(uuid, bigint, integer, text, text[], text) ROWS 1;
ALTER FUNCTION orc_claim_v2(uuid, bigint, integer, text, text[], text, text) ROWS 1;
ALTER FUNCTION orc_fetch_dispatch_v3(character varying[], character varying[], bigint, text,
                                     text, text[], text) ROWS 1;
