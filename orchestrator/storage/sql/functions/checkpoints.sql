-- Checkpoints and the side-effect ledger (checkpoints/): what a committed effect recorded is
-- final.

-- A committed side effect is history: nothing may make it pending, failed or different again.
CREATE OR REPLACE FUNCTION orc_side_effect_committed_is_final_v1() RETURNS trigger
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

CREATE OR REPLACE TRIGGER orc_side_effects_committed_is_final
    BEFORE UPDATE ON orc_side_effects
    FOR EACH ROW EXECUTE FUNCTION orc_side_effect_committed_is_final_v1();
