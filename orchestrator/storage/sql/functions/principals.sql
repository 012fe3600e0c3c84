-- Principals: who asked for a discard and who confirmed it, compared as persons (the two-person
-- rule), whatever the spelling of their recorded names. This is the rule (docs/api.md, "The
-- principal rule"); tests/test_principals.py holds a model of it, written apart, equal to it.

-- What a name looks like, from the looks of its characters (orc_principal_looks) joined in
-- order: spaces collapsed and trimmed, then NFD, and a dot above hidden by an i's or j's own dot
-- dropped.
CREATE OR REPLACE FUNCTION orc_principal_skeleton_v1(looks text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT regexp_replace(normalize(btrim(regexp_replace(looks, ' +', ' ', 'g'), ' '), NFD),
                          '([ij])\u0307+', '\1', 'g')
$$;

-- The characters of the name behind a recorded principal (a token's name, a CLI user's without
-- its OS user, or a bare name), in NFD (not NFKD: a compatibility character has a prototype of
-- its own as written; its look decomposes it), private-use characters dropped: (ch, n) in
-- order. The name case-folded is these in NFKD (orc_principal_persons_v1).
CREATE OR REPLACE FUNCTION orc_principal_chars_v1(recorded text)
RETURNS TABLE (ch text, n bigint)
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT c.ch, c.n
      FROM string_to_table(regexp_replace(normalize(
               CASE WHEN starts_with(recorded, 'token:') THEN substr(recorded, 7)
                    ELSE regexp_replace(recorded, ' \(cli:[^()]*\)$', '') END, NFD),
               '[\ue000-\uf8ff\U000f0000-\U0010ffff]', '', 'g'), NULL)
                WITH ORDINALITY AS c(ch, n)
$$;

-- The person behind a recorded principal: the two skeletons of its name, that of the name
-- case-folded (each character's `look`) and that of the name as written (`look_as_written`: a
-- capital I looks like a small l, as Unicode's confusables data says, which its case fold, i,
-- does not). Two recorded principals are one person when their persons share a skeleton
-- (`&&`): "Ik" is "ik"'s person and "lk"'s, though "ik" and "lk" are two. A rule of equal
-- derived values would have to join every chain of such pairs (i with l; through Greek
-- capital nu, which looks like N and folds to a nu that looks like v, n with v), and would
-- make names nobody confuses one person. The looks are written by `orchestrator migrate` from
-- Unicode's confusables data (orchestrator.domain.principals.look_rows).
--
-- The name case-folded is read in NFKD, the whole name at once, before any character is
-- looked up: a compatibility character that decomposes to a space and a combining mark (U+037A,
-- Greek ypogegrammeni: a space and U+0345, which folds to an iota, like i) has its mark put in
-- canonical order with the marks after it (a dot above, class 230, before U+0345, class 240),
-- as in the name's normal form (NFKC, how a new name is kept). Looked up alone, in NFD, its
-- look (" i") came before the dot, and the dot, taken for an i's own, was dropped: the name was
-- another person than its own normal form (issue: U+037A U+0307 was "i", its normal form
-- U+0307 U+0345 a dot and an i). The name as written stays in NFD: a compatibility character
-- has a prototype of its own.
CREATE OR REPLACE FUNCTION orc_principal_persons_v1(recorded text) RETURNS text[]
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    WITH c AS (SELECT ch, n FROM orc_principal_chars_v1(recorded)),
         k AS (SELECT k.ch, k.n
                 FROM string_to_table(normalize(
                          (SELECT coalesce(string_agg(ch, '' ORDER BY n), '') FROM c), NFKD),
                          NULL) WITH ORDINALITY AS k(ch, n))
    SELECT ARRAY[
               (SELECT orc_principal_skeleton_v1(coalesce(string_agg(
                           coalesce(l.look, k.ch), '' ORDER BY k.n), ''))
                  FROM k LEFT JOIN orc_principal_looks AS l ON l.ch = k.ch),
               (SELECT orc_principal_skeleton_v1(coalesce(string_agg(
                           coalesce(l.look_as_written, c.ch), '' ORDER BY c.n), ''))
                  FROM c LEFT JOIN orc_principal_looks AS l ON l.ch = c.ch)]
$$;

-- The skeleton of the name case-folded alone: the person of the release before 0057, whose
-- statements compare it (discard_requested_person <> orc_principal_person_v1(reviewer)) while
-- it runs beside this one; the first of orc_principal_persons_v1's two.
CREATE OR REPLACE FUNCTION orc_principal_person_v1(recorded text) RETURNS text
LANGUAGE sql STABLE STRICT PARALLEL SAFE AS $$
    SELECT (orc_principal_persons_v1(recorded))[1]
$$;

-- A dead letter's discard columns carry their persons, derived here and nowhere else.
CREATE OR REPLACE FUNCTION orc_dead_letter_persons_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.discard_requested_person := orc_principal_person_v1(NEW.discard_requested_by);
    NEW.discarded_person := orc_principal_person_v1(NEW.discarded_by);
    NEW.discard_requested_persons := orc_principal_persons_v1(NEW.discard_requested_by);
    NEW.discarded_persons := orc_principal_persons_v1(NEW.discarded_by);
    RETURN NEW;
END;
$$;

CREATE OR REPLACE TRIGGER orc_dead_letters_persons
    BEFORE INSERT OR UPDATE OF discard_requested_by, discarded_by ON orc_dead_letters
    FOR EACH ROW EXECUTE FUNCTION orc_dead_letter_persons_v1();
