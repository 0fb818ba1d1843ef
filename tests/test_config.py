"""Settings layers (defaults < TOML < DS_* variables < flags) and errors that name the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamkeep import config
from streamkeep.cli import build_parser


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
    args = parser.parse_args(["serve", "--no-metrics", "--cors-origins", "https://a.example, https://b.example"])
    cli = {config.cli_dest(s): getattr(args, config.cli_dest(s)) for s in config.SETTINGS}
    settings = config.load(None, env={}, cli=cli)
    assert settings.metrics.enabled is False and settings.metrics.port is None
    assert settings.http.cors_origins == "https://a.example,https://b.example"
    # The old singular name still works, in TOML and as seed 000's variable.
    toml = tmp_path / "old.toml"
    toml.write_text('[http]\ncors_origin = "https://c.example"\n')
    assert config.load(str(toml), env={}).http.cors_origins == "https://c.example"
    assert config.load(None, env={"DS_HTTP__CORS_ORIGIN": "https://d.example"}).http.cors_origins == "https://d.example"
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
