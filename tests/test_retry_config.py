"""The per-type config: the default file holds the design's values; bad files fail clearly."""

from pathlib import Path
from typing import Any

import pytest

import retry_config
from retry_config import (
    AdditiveJitter,
    ConfigError,
    FullJitter,
    JobRetryConfig,
    NoJitter,
    ProportionalJitter,
)

# The design's retry configuration spec.
SEED = {
    "http_request": (5, 3, 1_000, 60_000, 2, True, 600, 120_000, 30_000),
    "llm_generate": (3, 5, 5_000, 300_000, 3, True, 3_600, 300_000, 30_000),
    "run_agent": (3, 5, 5_000, 300_000, 3, True, 3_600, 300_000, 30_000),
    "execute_tool": (3, 3, 2_000, 120_000, 2, True, 1_200, 120_000, 10_000),
    "send_notification": (10, 5, 2_000, 60_000, 2, True, 300, 15_000, 10_000),
    "sweep_zombies": (2, 0, 1_000, 1_000, 1, False, 60, 30_000, 5_000),
    "expire_approvals": (2, 0, 1_000, 1_000, 1, False, 60, 30_000, 5_000),
}
# The design's taxonomy puts these beside http_request and send_notification.
TAXONOMY_TWINS = {"webhook_dispatch": "http_request", "approval_notify": "send_notification"}


def test_default_file_holds_the_design_job_types_with_their_values() -> None:
    config = retry_config.load()
    assert set(config.job_types) == set(SEED) | set(TAXONOMY_TWINS)
    expected = SEED | {name: SEED[twin] for name, twin in TAXONOMY_TWINS.items()}
    for name, (
        worker,
        app,
        base,
        cap,
        mult,
        jitter,
        job_s,
        call_ms,
        connect_ms,
    ) in expected.items():
        c = config.for_type(name)
        assert (c.worker_max_attempts, c.app_max_retries) == (worker, app), name
        assert (c.backoff.base_ms, c.backoff.cap_ms, c.backoff.multiplier) == (base, cap, mult)
        assert isinstance(c.backoff.jitter, FullJitter if jitter else NoJitter), name
        assert (c.job_timeout_seconds, c.call_timeout_ms, c.connect_timeout_ms) == (
            job_s, call_ms, connect_ms,
        )  # fmt: skip
    # Streams are cut after 60 s without a token.
    assert config.for_type("llm_generate").inter_chunk_timeout() == 60
    assert config.for_type("run_agent").inter_chunk_timeout() == 60
    assert config.for_type("http_request").inter_chunk_timeout() is None


def test_unlisted_types_use_the_defaults() -> None:
    config = retry_config.load()
    assert config.for_type("my_custom_type") == config.defaults
    assert config.defaults.backoff.cap_ms == 300_000  # the design's DEFAULT_BACKOFF_CONFIG


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "retry.toml"
    path.write_text(text)
    return path


def test_types_override_defaults_field_by_field(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [defaults]
        app_max_retries = 7
        [defaults.backoff]
        base_ms = 100
        cap_ms = 900
        jitter = { mode = "additive", max_ms = 300 }
        [job_types.a]
        worker_max_attempts = 4
        [job_types.a.backoff]
        cap_ms = 5000
        jitter = { mode = "proportional", ratio = 0.3 }
        [job_types.b]
        backoff = { jitter = "none" }
        [job_types.c]
        backoff = { jitter = true }
    """,
    )
    config = retry_config.load(path)
    a, b, c = (config.for_type(n) for n in "abc")
    assert (a.worker_max_attempts, a.app_max_retries) == (4, 7)
    assert (a.backoff.base_ms, a.backoff.cap_ms) == (100, 5_000)
    assert a.backoff.jitter == ProportionalJitter(ratio=0.3)
    assert b.backoff.jitter == NoJitter() and b.backoff.cap_ms == 900
    assert c.backoff.jitter == FullJitter()
    assert config.defaults.backoff.jitter == AdditiveJitter(max_ms=300)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("[job_types.http_request]\nworker_max_attempts = -1\n",
         ["job type 'http_request'", "field 'worker_max_attempts'", "greater than or equal to 1"]),
        ("[job_types.llm]\nbackof = 3\n", ["job type 'llm'", "field 'backof'", "Extra inputs"]),
        ("[job_types.t.backoff]\nbase_ms = 1000\ncap_ms = 10\n",
         ["job type 't'", "cap_ms (10) must be >= base_ms (1000)"]),
        ("[job_types.t]\nbackoff = { jitter = { mode = \"proportional\", ratio = 3 } }\n",
         ["job type 't'", "field 'backoff.jitter.ratio'"]),
        ("[job_types.t]\nbackoff = { jitter = \"sometimes\" }\n",
         ["job type 't'", "field 'backoff.jitter'"]),
        ("[defaults]\napp_max_retries = -2\n", ["defaults", "field 'app_max_retries'"]),
        ("[job_types.t]\nconnect_timeout_ms = 5000\ncall_timeout_ms = 100\n",
         ["job type 't'", "connect_timeout_ms (5000) must be <= call_timeout_ms (100)"]),
        ("[job_types.t]\njob_timeout_seconds = 1\ncall_timeout_ms = 5000\nconnect_timeout_ms = 10\n",
         ["an inner timeout has to fire first"]),
        ("[job_types.t]\njob_timeout_seconds = 60\nstep_timeout_seconds = 61\n",
         ["job type 't'", "step_timeout_seconds (61) must be <= job_timeout_seconds (60)"]),
        ("[job_types.t]\nstep_timeout_seconds = 0\n", ["job type 't'", "field 'step_timeout_seconds'"]),
        ("[job_types.t]\ncall_timeout_ms = 2000\nconnect_timeout_ms = 10\nstep_timeout_seconds = 1\n",
         ["call_timeout_ms (2000) must be <= the step timeout (1000 ms)"]),
        ("[job_types.t]\ntool_timeouts_ms = { kubectl = 700000 }\n",
         ["job type 't'", "tool_timeouts_ms.kubectl (700000) must be <= the step timeout (600000 ms)"]),
        ("[job_types.t]\ntool_timeouts_ms = { kubectl = -5 }\n",
         ["job type 't'", "field 'tool_timeouts_ms.kubectl'", "greater than 0"]),
        ("[job_types.llm_generate]\nfallback_models = [\"b\", \"\"]\n",
         ["job type 'llm_generate'", "field 'fallback_models.1'", "at least 1 character"]),
        ("[job_types.llm_generate]\nfallback_models = \"b\"\n",
         ["job type 'llm_generate'", "field 'fallback_models'", "valid list"]),
        ("[job_types.llm_generate]\nfallback_after_seconds = -1\n",
         ["job type 'llm_generate'", "field 'fallback_after_seconds'", "greater than or equal to 0"]),
        ("[limits.graphile_worker_queue]\nconcurrency = 5\n",
         ["[limits.graphile_worker_queue]", "reserved by the orchestrator"]),
        ("[limits.p]\nconcurrency = 4\ntenant_share = 1.5\n",
         ["tenant_share", "less than or equal to 1"]),
        ("[limits.p]\nconcurrency = 4\ntenant_share = 0\n",
         ["tenant_share", "greater than 0"]),
        ('[limits.p]\nconcurrency = 4\nshare_by = "none"\ntenant_share = 0.5\n',
         ["tenant_share caps one share of a key", 'share_by = "none" makes none']),
        ("[job_type.t]\n", ["unknown top-level key(s) 'job_type'"]),
        ("job_types = 3\n", ["[job_types] must be a table"]),
        ("[job_types\n", ["not valid TOML"]),
    ],
)  # fmt: skip
def test_bad_files_name_the_file_the_type_and_the_field(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        retry_config.load(path)
    message = str(info.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, "[job_types.a]\nworker_max_attempts = 0\n[job_types.b]\nzzz = 1\n")
    with pytest.raises(ConfigError) as info:
        retry_config.load(path)
    assert "job type 'a'" in str(info.value) and "job type 'b'" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        retry_config.load(tmp_path / "nope.toml")


def test_the_environment_chooses_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator import Orchestrator

    path = write(tmp_path, "[job_types.only_here]\napp_max_retries = 9\n")
    monkeypatch.setenv("ORCHESTRATOR_RETRY_CONFIG", str(path))
    assert Orchestrator().retry_config.for_type("only_here").app_max_retries == 9
    monkeypatch.setenv("ORCHESTRATOR_RETRY_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        Orchestrator()


def test_the_step_timeout_defaults_to_ten_minutes_and_never_outlasts_the_job() -> None:
    assert JobRetryConfig().step_timeout() == 600
    short = JobRetryConfig(job_timeout_seconds=60, call_timeout_ms=10_000, connect_timeout_ms=10)
    assert short.step_timeout() == 60
    assert short.model_copy(update={"step_timeout_seconds": 30}).step_timeout() == 30
    # a submit that shortens the job's timeout shortens its steps too
    assert JobRetryConfig(step_timeout_seconds=300).step_timeout(job_timeout_seconds=20) == 20


def test_tools_have_their_own_call_limits_and_the_rest_use_the_call_timeout() -> None:
    config = retry_config.load().for_type("execute_tool")
    assert config.call_timeout("kubectl") == 30
    assert config.call_timeout("file_write") == 10
    assert config.call_timeout("browser_navigate") == 120
    assert config.call_timeout("grep") == config.call_timeout() == 120


def test_fallback_models_are_off_by_default_and_set_per_type(tmp_path: Path) -> None:
    default = retry_config.load()
    assert default.for_type("llm_generate").fallback_models == []
    assert default.for_type("run_agent").fallback_after_seconds == 30
    path = write(
        tmp_path,
        '[job_types.llm_generate]\nfallback_models = ["b", "c"]\nfallback_after_seconds = 2.5\n',
    )
    config = retry_config.load(path).for_type("llm_generate")
    assert (config.fallback_models, config.fallback_after_seconds) == (["b", "c"], 2.5)


def test_tool_limits_merge_over_the_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[defaults]\ntool_timeouts_ms = { kubectl = 30000, ls = 1000 }\n"
        "[job_types.t]\ntool_timeouts_ms = { ls = 2000 }\n",
    )
    assert retry_config.load(path).for_type("t").tool_timeouts_ms == {"kubectl": 30000, "ls": 2000}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[job_types.t.backoff]\nbase_ms = 1000000000000000\ncap_ms = 1000000000000000\n",
         "backoff.base_ms"),
        ("[job_types.t]\nworker_max_attempts = 10000000000\n", "worker_max_attempts"),
        ("[job_types.t]\napp_max_retries = 2147483648\n", "app_max_retries"),
        ("[job_types.t]\njob_timeout_seconds = 99999999999\n", "job_timeout_seconds"),
        ("[job_types.t]\nbackoff = { jitter = { mode = \"additive\", max_ms = 9999999999 } }\n",
         "backoff.jitter.max_ms"),
    ],
)  # fmt: skip
def test_values_the_runtime_or_the_columns_cannot_hold_are_refused_at_load(
    tmp_path: Path, text: str, field: str
) -> None:
    with pytest.raises(ConfigError, match=rf"field '{field}': .*less than or equal to 2147483647"):
        retry_config.load(write(tmp_path, text))


def test_a_defaults_problem_is_reported_against_defaults_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "[defaults]\napp_max_retries = -2\n[job_types.a]\nworker_max_attempts = 2\n"
        "[job_types.b]\napp_max_retries = 1\nworker_max_attempts = 0\n",
    )
    with pytest.raises(ConfigError) as info:
        retry_config.load(path)
    assert str(info.value).splitlines() == [
        f"{path}: defaults: field 'app_max_retries': Input should be greater than or equal to 0",
        f"{path}: job type 'b': field 'worker_max_attempts': Input should be greater than or "
        "equal to 1",
    ]


def test_a_table_naming_no_known_type_is_refused_with_the_closest_name(tmp_path: Path) -> None:
    config = retry_config.load(
        write(tmp_path, "[job_types.http_requset]\n[job_types.zzz]\n[job_types.http_request]\n")
    )
    with pytest.raises(ConfigError) as info:
        config.check_names({"http_request", "llm_generate"})
    assert str(info.value).splitlines() == [
        f"{config.path}: job type 'http_requset' is neither registered nor built in; "
        "did you mean 'http_request'?",
        f"{config.path}: job type 'zzz' is neither registered nor built in",
    ]
    config.check_names({"http_request", "http_requset", "zzz"})  # all known: fine


def test_the_built_in_types_are_the_default_files_tables() -> None:
    assert retry_config.built_in_types() == set(retry_config.load().job_types)


async def test_a_worker_refuses_a_config_naming_a_type_the_application_lacks(
    make_orc: Any, tmp_path: Path
) -> None:
    from tests.support import scripted

    orc = make_orc(retry_config=write(tmp_path, "[job_types.scriptd]\napp_max_retries = 1\n"))
    scripted.register(orc)
    await orc.open()
    with pytest.raises(ConfigError, match=r"'scriptd' is neither .* did you mean 'scripted'"):
        await orc.run_worker(install_signal_handlers=False)
