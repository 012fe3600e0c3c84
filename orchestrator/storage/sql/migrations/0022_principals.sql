-- 0022_principals: the two-person rule compares persons, not the text a reviewer was recorded as.
--
-- compatible-with-older-workers: yes
--
-- A discard's reviewers were compared as recorded: `alice` (the previous release's command line),
-- `alice (cli:OS_USER)` (today's command line) and `token:alice` (the API) passed for three
-- people, so alice could confirm her own request. Each reviewer now also has a person: the name
-- without its kind, in the form orchestrator.domain.principals.person_of gives it (NFKC,
-- case-folded, trimmed, inner whitespace collapsed, invisible and control characters dropped,
-- Cyrillic and Greek look-alikes of Latin letters and the digits 0 and 1 mapped to the Latin
-- letters; docs/api.md, "The principal rule"). The database derives it, in a trigger, from the
-- recorded text whoever writes it (this release, the previous one's command line during a
-- rolling deploy, SQL by hand), and refuses a discard confirmed by its requester's person.
-- The recorded text stays as it was written, for the record. Letters already discarded keep
-- their reviewers (the check is NOT VALID: it holds for every write from now on).
--
-- For names written by this release (already in normal form) the function and person_of agree
-- (tests/test_principals.py checks it); for legacy text with other hidden characters or other
-- scripts, lower() is the database's locale's, an approximation of Python's casefold.

CREATE FUNCTION orc_principal_person_v1(recorded text) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT normalize(lower(btrim(regexp_replace(regexp_replace(
        translate(
            normalize(CASE WHEN starts_with(recorded, 'token:') THEN substr(recorded, 7)
                           ELSE regexp_replace(recorded, ' \(cli:[^()]*\)$', '') END, NFKC),
            'АВЕКМНОРСТУХЅІЈҮԚԜӀЗаеорсухѕіјһԁԛԝӏгпвкмнтΑΒΕΖΗΙΚΜΝΟΡΤΥΧαγικνορυχ01',
            'ABEKMHOPCTYXSIJYQWl3aeopcyxsijhdqwlrnbkmhtABEZHIKMNOPTYXayikvopuxol'),
        '[\u0001-\u001f\u007f-\u009f\u00ad\u034f\u0600-\u0605\u061c\u06dd\u070f\u115f\u1160'
        '\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u2028-\u202e\u2060-\u206f\u2800\u3164'
        '\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e0fff]', '', 'g'),
        '[[:space:]]+', ' ', 'g'), ' ')), NFKC)
$$;

ALTER TABLE orc_dead_letters
    ADD COLUMN discard_requested_person text,
    ADD COLUMN discarded_person text;

UPDATE orc_dead_letters
   SET discard_requested_person = orc_principal_person_v1(discard_requested_by),
       discarded_person = orc_principal_person_v1(discarded_by)
 WHERE discard_requested_by IS NOT NULL OR discarded_by IS NOT NULL;

ALTER TABLE orc_dead_letters
    ADD CONSTRAINT orc_dead_letters_two_persons
    CHECK (discarded_person IS NULL OR discarded_person <> discard_requested_person) NOT VALID;

CREATE FUNCTION orc_dead_letter_persons_v1() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.discard_requested_person := orc_principal_person_v1(NEW.discard_requested_by);
    NEW.discarded_person := orc_principal_person_v1(NEW.discarded_by);
    RETURN NEW;
END;
$$;

CREATE TRIGGER orc_dead_letters_persons
    BEFORE INSERT OR UPDATE OF discard_requested_by, discarded_by ON orc_dead_letters
    FOR EACH ROW EXECUTE FUNCTION orc_dead_letter_persons_v1();
