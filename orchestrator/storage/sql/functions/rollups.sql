-- Rollups: how far the per-minute counts of finished jobs have been rolled up.

-- The rollups' watermark: jobs finished before it are counted in orc_rollups.
CREATE OR REPLACE FUNCTION orc_rolled_up_to_v1() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT rolled_up_to FROM orc_rollup_watermark
$$;
