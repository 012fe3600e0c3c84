-- 0050_flow_limits_learned: a flow limit may learn its keys' limits from their provider's
-- replies (docs/flow-control.md, "Limits learned from the provider"). A limit says so
-- (`learn`, from the retry config's `learn = true`); each key keeps the provider's limits of
-- requests and units per its period, the latest a reply said (orc_flow_learn_v1, under the
-- key's lock, the one writer), and every reader of a key's window meets its limit lowered to
-- them (orc_flow_limit_of_v1; a configured limit stays a ceiling). A reply with a limit that
-- has nothing remaining holds the key until its reset, as a pause by the provider.
-- Compatible: the release before writes its config's limits without `learn` (false: nothing
-- learned applies to them) and never calls the new functions; its claims meet the learned
-- limits through the functions this migration revises, which it calls unchanged.
--
-- compatible-with-older-workers: yes
-- revises: functions/flow.sql ac1eef0479e61477754757b55207d0fe5f85ccd52367560c2587f9dccdccc5e1

ALTER TABLE orc_flow_limits ADD COLUMN learn boolean NOT NULL DEFAULT false;

ALTER TABLE orc_flow_keys
    ADD COLUMN learned_requests integer CHECK (learned_requests > 0),
    ADD COLUMN learned_units bigint CHECK (learned_units > 0),
    ADD COLUMN learned_at timestamptz;  -- when what the key learned last changed
