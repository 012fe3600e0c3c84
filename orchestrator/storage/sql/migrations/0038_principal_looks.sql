-- 0038_principal_looks: what each character of a principal's name looks like, for
-- orc_principal_person_v1 (functions/principals.sql), which no longer holds a table of
-- look-alike letters of its own. `orchestrator migrate` fills it from Unicode's confusables data
-- (UTS #39) through orchestrator.domain.principals, the Python side of the same rule, and
-- derives again the requester's person of every discard awaiting its confirmation.
--
-- The release before runs on it: its workers write dead letters through the same trigger,
-- whose persons it now derives by this table.
--
-- compatible-with-older-workers: yes
-- revises: functions/principals.sql c8f742c756b790fda114ee50671192086c0ca1c006fd15476e0053c8ea946033

CREATE TABLE orc_principal_looks (
    ch   text PRIMARY KEY,
    look text NOT NULL
);
