-- Principals: who asked for a discard and who confirmed it, compared as persons (the two-person
-- rule), whatever the spelling of their recorded names.

-- The person behind a recorded principal: a token's name or a CLI user without its host, as
-- it looks: each character in NFKD replaced by its look (orc_principal_looks, written by
-- `orchestrator migrate` from Unicode's confusables data: case-folded, mapped to its UTS #39
-- prototype, "" for a character nobody sees), private-use characters dropped, spaces collapsed
-- and trimmed, then NFD, and a dot above hidden by an i's or j's own dot dropped.
-- orchestrator.domain.principals.person_of is the same rule in Python, held equal by a property
-- test.
CREATE OR REPLACE FUNCTION orc_principal_person_v1(recorded text) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    SELECT regexp_replace(normalize(btrim(regexp_replace(coalesce(string_agg(
               coalesce(l.look, c.ch), '' ORDER BY c.n), ''), ' +', ' ', 'g'), ' '), NFD),
           '([ij])\u0307+', '\1', 'g')
      FROM string_to_table(regexp_replace(normalize(
               CASE WHEN starts_with(recorded, 'token:') THEN substr(recorded, 7)
                    ELSE regexp_replace(recorded, ' \(cli:[^()]*\)$', '') END, NFKD),
               '[\ue000-\uf8ff\U000f0000-\U0010ffff]', '', 'g'), NULL)
                WITH ORDINALITY AS c(ch, n)
      LEFT JOIN orc_principal_looks AS l ON l.ch = c.ch
$$;

-- A dead letter's discard columns carry their persons, derived here and nowhere else.
CREATE OR REPLACE FUNCTION orc_dead_letter_persons_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.discard_requested_person := orc_principal_person_v1(NEW.discard_requested_by);
    NEW.discarded_person := orc_principal_person_v1(NEW.discarded_by);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_dead_letters_persons
    BEFORE INSERT OR UPDATE OF discard_requested_by, discarded_by ON orc_dead_letters
    FOR EACH ROW EXECUTE FUNCTION orc_dead_letter_persons_v1();
