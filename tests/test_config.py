"""Settings layers (defaults < TOML < DS_* variables < flags) and errors that name the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamkeep import config
from streamkeep.cli import build_parser, parse_ttl


def test_layers_later_wins(tmp_path: Path) -> None:
    toml = tmp_path / "streamkeep.toml"
    toml.write_text('[server]\nport = 5000\nlong_poll_timeout = 5\n[limits]\nmax_body_bytes = "2MiB"\n')
    settings = config.load(str(toml), env={})
    assert (settings.server.port, settings.server.long_poll_timeout) == (5000, 5.0)
    assert settings.limits.max_body_bytes == 2 << 20
    settings = config.load(str(toml), env={"DS_SERVER__PORT": "6000"})
    assert settings.server.port == 6000
    settings = config.load(str(toml), env={"DS_SERVER__PORT": "6000"}, cli={"port": "7000"})
    assert settings.server.port == 7000 and settings.server.long_poll_timeout == 5.0


def test_defaults_without_anything() -> None:
    settings = config.load(None, env={})
    assert (settings.server.host, settings.server.port) == ("127.0.0.1", 4437)
    assert settings.server.sse_close_after == 60.0 and settings.storage.mode == "disk"


def test_seed_000_variable_names_work() -> None:
    settings = config.load(None, env={"DS_SERVER__LONG_POLL_TIMEOUT_SECS": "2"})
    assert settings.server.long_poll_timeout == 2.0


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"DS_SERVER__PORT": "99999"}, "server.port"),
        ({"DS_SERVER__LONG_POLL_TIMEOUT": "-1"}, "server.long_poll_timeout"),
        ({"DS_LIMITS__MAX_BODY_BYTES": "lots"}, "limits.max_body_bytes"),
        ({"DS_STORAGE__MODE": "floppy"}, "storage.mode"),
        ({"DS_TLS__CERT": "/nonexistent.pem"}, "tls.cert"),
    ],
)
def test_bad_values_name_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(config.ConfigError, match=named.replace(".", r"\.")):
        config.load(None, env=env)


def test_unknown_toml_key_and_broken_toml(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("[server]\nprot = 1\n")
    with pytest.raises(config.ConfigError, match="unknown setting \\[server\\] prot"):
        config.load(str(toml), env={})
    toml.write_text("[server\n")
    with pytest.raises(config.ConfigError, match="not valid TOML"):
        config.load(str(toml), env={})


def test_tls_needs_both_files(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(config.ConfigError, match="go together"):
        config.load(None, env={}, cli={"tls_cert": str(cert)})


def test_help_lists_every_setting() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = serve.format_help()
    for setting in config.SETTINGS:
        assert setting.cli_flag in text and setting.env_var in text


def test_bad_config_fails_at_start_with_exit_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "streamkeep", "serve", "--port", "nope"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "server.port" in result.stderr and "--port" in result.stderr


def test_production_settings(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["serve", "--no-metrics", "--cors-origins", "https://a.example, https://b.example"]
    )
    cli = {config.cli_dest(s): getattr(args, config.cli_dest(s)) for s in config.SETTINGS}
    settings = config.load(None, env={}, cli=cli)
    assert settings.metrics.enabled is False and settings.metrics.port is None
    assert settings.http.cors_origins == "https://a.example,https://b.example"
    # The old singular name still works, in TOML and as seed 000's variable.
    toml = tmp_path / "old.toml"
    toml.write_text('[http]\ncors_origin = "https://c.example"\n')
    assert config.load(str(toml), env={}).http.cors_origins == "https://c.example"
    assert (
        config.load(None, env={"DS_HTTP__CORS_ORIGIN": "https://d.example"}).http.cors_origins
        == "https://d.example"
    )
    secret = "a-shared-secret-of-at-least-32-bytes"
    assert config.load(None, env={"DS_AUTH__JWT_SECRET": secret}).auth.jwt_secret == secret


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"DS_HTTP__CORS_ORIGINS": "*,https://a.example"}, "http.cors_origins"),
        ({"DS_HTTP__CORS_ORIGINS": "https://a.example/path"}, "http.cors_origins"),
        ({"DS_AUTH__JWKS_URL": "http://issuer.example/jwks.json"}, "auth.jwks_url"),
        ({"DS_AUTH__LINK_KEYS": "k1=short"}, "auth.link_keys"),
        ({"DS_AUTH__JWT_SECRET": "too-short"}, "auth.jwt_secret"),
        ({"DS_METRICS__PORT": "70000"}, "metrics.port"),
    ],
)
def test_bad_production_settings_name_the_setting(env: dict[str, str], named: str) -> None:
    with pytest.raises(config.ConfigError, match=named.replace(".", r"\.")):
        config.load(None, env=env)


# ---- one syntax for durations and sizes, in every layer ----------------------------------------

DURATIONS = [s for s in config.SETTINGS if s.parse in (config.duration, config.duration_or_off)]
SIZES = [s for s in config.SETTINGS if s.parse is config.byte_size]


def _from_layer(setting: config.Setting, layer: str, raw: object, tmp_path: Path) -> object:
    """`setting` as loaded when `raw` comes from `layer` (toml, env or flag) and nothing else."""
    if layer == "toml":
        toml = tmp_path / "layer.toml"
        value = f'"{raw}"' if isinstance(raw, str) else str(raw)
        toml.write_text(f"[{setting.section}]\n{setting.name} = {value}\n")
        settings = config.load(str(toml), env={})
    elif layer == "env":
        settings = config.load(None, env={setting.env_var: str(raw)})
    else:
        args = build_parser().parse_args(["serve", setting.cli_flag, str(raw)])
        cli = {config.cli_dest(s): getattr(args, config.cli_dest(s)) for s in config.SETTINGS}
        settings = config.load(None, env={}, cli=cli)
    return getattr(getattr(settings, setting.section), setting.name)


def test_the_settings_of_each_kind_are_known() -> None:
    names = {f"{s.section}.{s.name}" for s in DURATIONS}
    assert {"storage.segment_max_age", "server.long_poll_timeout", "retention.max_age"} <= names
    assert "limits.max_body_bytes" in {f"{s.section}.{s.name}" for s in SIZES}


@pytest.mark.parametrize("layer", ["toml", "env", "flag"])
@pytest.mark.parametrize("setting", DURATIONS, ids=lambda s: s.cli_flag)
def test_every_duration_takes_seconds_and_units_in_every_layer(
    setting: config.Setting, layer: str, tmp_path: Path
) -> None:
    for raw, seconds in [("2", 2.0), ("0.5", 0.5), ("500ms", 0.5), ("90s", 90.0), ("15m", 900.0),
                         ("12h", 43_200.0), ("7d", 604_800.0), ("2w", 1_209_600.0), ("1.5H", 5400.0)]:  # fmt: skip
        assert _from_layer(setting, layer, raw, tmp_path) == seconds, raw
    if layer == "toml":  # TOML numbers are seconds as they are
        assert _from_layer(setting, layer, 3, tmp_path) == 3.0
        assert _from_layer(setting, layer, 0.25, tmp_path) == 0.25


@pytest.mark.parametrize("layer", ["toml", "env", "flag"])
@pytest.mark.parametrize("setting", SIZES, ids=lambda s: s.cli_flag)
def test_every_size_takes_bytes_and_units_in_every_layer(
    setting: config.Setting, layer: str, tmp_path: Path
) -> None:
    # 64 MiB keeps --max-inflight-body-bytes at least --max-body-bytes whichever of the two is set.
    for raw in ["67108864", "64MiB", "65536KiB", "64M", "64mb", "64 MiB"]:
        assert _from_layer(setting, layer, raw, tmp_path) == 64 << 20, raw
    if layer == "toml":
        assert _from_layer(setting, layer, 64 << 20, tmp_path) == 64 << 20


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        ("0", 0),
        ("1B", 1),
        ("2KB", 2048),
        ("3k", 3072),
        ("1GiB", 1 << 30),
        ("1TiB", 1 << 40),
        ("2tb", 2 << 40),
    ],
)
def test_size_units_are_binary(raw: str, size: int) -> None:
    assert config.byte_size(raw) == size


@pytest.mark.parametrize("layer", ["toml", "env", "flag"])
@pytest.mark.parametrize(
    ("flag", "raw", "says"),
    [
        (
            "--segment-max-age",
            "2x",
            "is not a duration; use 0 (off), seconds or 500ms, 90s, 15m, 12h, 7d, 2w",
        ),
        ("--segment-max-age", "-1", "is not a duration"),
        ("--segment-max-age", "1e3", "is not a duration"),
        (
            "--long-poll-timeout",
            "0",
            "is not a positive duration; use seconds or 500ms, 90s, 15m, 12h, 7d, 2w",
        ),
        ("--long-poll-timeout", "5 minutes", "is not a duration"),
        ("--retention-max-age", "soon", "is not a duration"),
        ("--max-body-bytes", "12 parsecs", "is not a size; use bytes or 256KiB, 64MiB, 1GiB, 1TiB"),
        ("--max-body-bytes", "1.5MiB", "is not a size"),
        ("--cold-cache-bytes", "-5", "is not a size"),
    ],
)
def test_bad_durations_and_sizes_say_what_is_accepted(
    flag: str, raw: str, says: str, layer: str, tmp_path: Path
) -> None:
    setting = next(s for s in config.SETTINGS if s.cli_flag == flag)
    origin = {"toml": "layer.toml", "env": "$" + setting.env_var, "flag": flag}[layer]
    with pytest.raises(config.ConfigError) as refused:
        _from_layer(setting, layer, raw, tmp_path)
    message = str(refused.value)
    assert f"{setting.section}.{setting.name} from " in message and origin in message
    assert f"{raw!r} {says}" in message


@pytest.mark.parametrize("raw", [-1, float("inf"), float("nan"), True])
def test_toml_numbers_that_are_no_duration_are_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        config.duration_or_off(raw)


def test_toml_sizes_refuse_negative_numbers(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match=r"-5 is not a size"):
        _from_layer(next(s for s in SIZES), "toml", -5, tmp_path)


def test_retention_rules_take_the_same_syntax(tmp_path: Path) -> None:
    toml = tmp_path / "rules.toml"
    toml.write_text('[[retention]]\nstreams = "logs/**"\nmax_age = "2w"\nmax_bytes = "1TiB"\n')
    (rule,) = config.load(str(toml), env={}).retention.rules
    assert (rule["max_age"], rule["max_bytes"]) == (1_209_600.0, 1 << 40)
    toml.write_text('[[retention]]\nstreams = "logs/**"\nmax_age = "soon"\n')
    with pytest.raises(
        config.ConfigError, match=r"\[\[retention\]\] number 1: max_age 'soon' is not a duration"
    ):
        config.load(str(toml), env={})
    toml.write_text('[[retention]]\nstreams = "logs/**"\ncompact = "state"\ncompact_ratio = 0.5\n')
    with pytest.raises(config.ConfigError, match=r"compact_ratio 0\.5 is not a number of at least 1"):
        config.load(str(toml), env={})


def test_help_shows_the_syntax_and_the_segment_max_age_of_the_issue() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    text = " ".join(serve.format_help().split())
    assert config.DURATION_SYNTAX in text and config.SIZE_SYNTAX in text
    assert "--segment-max-age DURATION" in text and "--max-body-bytes SIZE" in text
    assert "h11" not in text  # the lean edge parses HTTP/1.1 with llhttp
    metavars = {
        action.option_strings[0]: action.metavar for action in serve._actions if action.option_strings
    }
    assert {flag for flag, shown in metavars.items() if shown == "SIZE"} == {s.cli_flag for s in SIZES}
    assert {flag for flag, shown in metavars.items() if shown == "DURATION"} == {
        s.cli_flag for s in DURATIONS
    }
    args = build_parser().parse_args(["serve", "--segment-max-age", "2s", "--storage", "memory"])
    cli = {config.cli_dest(s): getattr(args, config.cli_dest(s)) for s in config.SETTINGS}
    assert config.load(None, env={}, cli=cli).storage.segment_max_age == 2.0


def test_other_commands_take_the_same_durations() -> None:
    assert parse_ttl("2w") == 1_209_600 and parse_ttl("90") == 90 and parse_ttl("1.5h") == 5400
    with pytest.raises(ValueError, match="--ttl '500ms' is shorter"):
        parse_ttl("500ms")
    with pytest.raises(ValueError, match="--ttl 'soon' is not a duration"):
        parse_ttl("soon")
    archive = build_parser().parse_args(["archive", "status", "--orphan-min-age", "2h"])
    assert archive.orphan_min_age == 7200.0
