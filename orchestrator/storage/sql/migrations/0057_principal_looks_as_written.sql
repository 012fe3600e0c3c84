-- 0057_principal_looks_as_written: a name is compared as written and case-folded (issue 43;
-- docs/api.md, "The principal rule").
--
-- Names were case-folded before their characters were mapped to what they look like, so the
-- mappings of Unicode's confusables data from capitals were lost: capital I (U+0049), Greek
-- capital iota, Cyrillic capital palochka and U+01C0 look like a small l, but fold to letters
-- that look like an i, and "Ik" and "Ӏk" passed for another person than "lk". Names are now
-- kept as written (their case too), and a name has two skeletons: that of the name case-folded
-- (orc_principal_looks.look, as before) and that of the name as written, each character's
-- prototype first and then case-folded (look_as_written, written by `orchestrator migrate`
-- from the same data). Two names are one person when they share one (orc_principal_persons_v1,
-- functions/principals.sql, which says why it is not an equality of one derived value).
--
-- orc_dead_letters keeps each reviewer's two skeletons (discard_requested_persons,
-- discarded_persons, derived by the trigger for every writer) and refuses a confirmation
-- whose skeletons meet the request's. `migrate` derives the requester's skeletons of every
-- discard awaiting confirmation once the looks are written; a discard already confirmed keeps
-- its reviewers (the check is NOT VALID: it holds for every write from now on).
--
-- The release before runs on it: its workers write dead letters through the same trigger; its
-- command line and API compare discard_requested_person, still derived (the skeleton of the
-- name case-folded), and what it lets through of the new rule this check refuses. Its own
-- migrate, on this newer schema, leaves the looks alone.
--
-- compatible-with-older-workers: yes
-- revises: functions/principals.sql 274b7c52d5e7ede9f006fb54c04c5ad202aed8251dbf3a5cb9e6602682d4d0c5

ALTER TABLE orc_principal_looks ADD COLUMN look_as_written text;
UPDATE orc_principal_looks SET look_as_written = look;  -- until migrate writes them, below
ALTER TABLE orc_principal_looks ALTER COLUMN look_as_written SET NOT NULL;

ALTER TABLE orc_dead_letters
    ADD COLUMN discard_requested_persons text[],
    ADD COLUMN discarded_persons text[];

ALTER TABLE orc_dead_letters
    ADD CONSTRAINT orc_dead_letters_two_persons_as_written
    CHECK (discarded_persons IS NULL OR NOT discarded_persons && discard_requested_persons)
    NOT VALID;
