-- 0074_every_claim_says_who_waits: the claim's row says whether jobs wait for the claimed job
-- (has_dependants, docs/workflows.md), so a claim made after its fetch (orc_claim_v2: another
-- transaction held the job's row when the fetch met it, or the replay's claim) tells its worker
-- to fetch after the job's end, as a claim made by the fetch did: before, only the fetch added
-- it, and a chain's link claimed later released its child in a transaction of its own.
--
-- The claim's row grows a column, so orc_claim_v1 and orc_claim_v2 are made anew (claim.sql):
-- the release before reads claims as rows or JSON into a model that ignores a column it does not
-- know, and its fetch's claims carry the key as they did.
--
-- compatible-with-older-workers: yes
-- revises: functions/claim.sql 05321d0197450ce2598c4026712efd941083345f4c31c64d0a5d6fee9b9f1a27

DROP FUNCTION IF EXISTS orc_claim_v2(uuid, bigint, integer, text, text[], text, text);
DROP FUNCTION IF EXISTS orc_claim_v1(uuid, bigint, integer, text, text[], text);
