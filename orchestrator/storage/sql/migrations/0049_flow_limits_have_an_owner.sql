-- 0049_flow_limits_have_an_owner: a flow limit belongs to what wrote it. The retry config's
-- limits (`config`) are written, changed and deleted by the config's sync, which since 0046
-- deletes a limit the file no longer has; the Graphile Worker schema's limit of its serial
-- queues (`graphile_worker`, written by its install: docs/graphile.md) is its own, and no
-- config's sync may change or delete it. Compatible: the release before inserts and updates
-- its config's limits without naming an owner (the default) and never deletes one.
--
-- compatible-with-older-workers: yes

ALTER TABLE orc_flow_limits
    ADD COLUMN owner text NOT NULL DEFAULT 'config'
        CONSTRAINT orc_flow_limits_owner_check CHECK (owner IN ('config', 'graphile_worker'));

UPDATE orc_flow_limits SET owner = 'graphile_worker' WHERE name = 'graphile_worker_queue';
