-- Principals: who asked for a discard and who confirmed it, compared as persons (the two-person
-- rule), whatever the spelling of their recorded names.

-- The person behind a recorded principal: a token's name or a CLI user without its host,
-- case-folded, NFKC-normalized, look-alike letters mapped, invisible characters removed.
-- orchestrator.domain.principals.person_of is the same rule in Python, held equal by a property
-- test.
CREATE OR REPLACE FUNCTION orc_principal_person_v1(recorded text) RETURNS text
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
