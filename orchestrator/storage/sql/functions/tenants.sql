-- Tenants: a row's tenant derived from the row it comes from, never taken from its writer:
-- a replayed job's from its dead letter, a dead letter's from its job.
CREATE OR REPLACE FUNCTION orc_inherited_tenant_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'orc_jobs' THEN
        SELECT l.tenant_id INTO NEW.tenant_id FROM orc_dead_letters AS l WHERE l.id = NEW.replay_of;
    ELSE
        SELECT j.tenant_id INTO NEW.tenant_id FROM orc_jobs AS j WHERE j.id = NEW.job_id;
    END IF;
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_jobs_replay_tenant
    BEFORE INSERT ON orc_jobs
    FOR EACH ROW WHEN (NEW.replay_of IS NOT NULL AND NEW.tenant_id IS NULL)
    EXECUTE FUNCTION orc_inherited_tenant_v1();

CREATE OR REPLACE TRIGGER orc_dead_letters_tenant
    BEFORE INSERT OR UPDATE OF job_id, tenant_id ON orc_dead_letters
    FOR EACH ROW EXECUTE FUNCTION orc_inherited_tenant_v1();
