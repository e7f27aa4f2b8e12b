"""The ``pagedserve`` command line: subcommands, and every EngineConfig field as a flag."""

from __future__ import annotations

import pytest

from pagedserve.engine.config import EngineConfig
from pagedserve.server import cli
from pagedserve.server.engine_args import config_from_args


def _parse(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


def test_every_engine_field_is_a_documented_flag(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for name in EngineConfig.field_names():
        assert "--" + name.replace("_", "-") in text, name
    for flag in ("--host", "--port", "--served-model-name", "--api-key",
                 "--max-waiting-requests", "--shutdown-timeout", "--log-level",
                 "--no-enable-prefix-caching", "--enforce-eager"):
        assert flag in text, flag
    # Each engine flag states its default exactly once, switches included.
    entries = " ".join(text.split()).split(" --")
    for name in EngineConfig.field_names():
        flag = name.replace("_", "-")
        i = next(i for i, e in enumerate(entries) if e.startswith((flag + " ", flag + ",")))
        alias = entries[i + 1] if i + 1 < len(entries) else ""
        entry = entries[i] + (alias if alias.startswith("no-" + flag) else "")
        assert entry.count("(default:") == 1, entry


def test_defaults_equal_the_dataclass():
    assert config_from_args(_parse()) == EngineConfig()


def test_flags_map_to_fields_with_types():
    args = _parse("--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "0.25",
                  "--no-enable-prefix-caching", "--enforce-eager", "--dtype", "float32",
                  "--max-model-len", "none", "--model", "some/model",
                  "--kv-cache-dtype", "bfloat16")
    cfg = config_from_args(args)
    assert cfg.max_num_batched_tokens == 256 and cfg.kv_cache_memory_gb == 0.25
    assert cfg.enable_prefix_caching is False and cfg.enforce_eager is True
    assert cfg.dtype == "float32" and cfg.max_model_len is None and cfg.model == "some/model"
    assert cfg.kv_cache_dtype == "bfloat16"


def test_bad_values_are_rejected():
    with pytest.raises(SystemExit):
        _parse("--max-num-seqs", "many")
    with pytest.raises(ValueError):
        config_from_args(_parse("--dtype", "int3"))


def test_serve_options():
    args = _parse("my-model", "--port", "0", "--served-model-name", "a", "b",
                  "--max-waiting-requests", "4", "--shutdown-timeout", "2.5")
    assert args.model_tag == "my-model" and args.port == 0
    assert args.served_model_name == ["a", "b"] and args.max_waiting_requests == 4
    assert args.shutdown_timeout == 2.5


def test_subcommand_hook():
    assert ("serve", "pagedserve.server.serve_cli") in cli.SUBCOMMANDS
    assert _parse()._run.__module__ == "pagedserve.server.serve_cli"


def test_hardening_flags_and_defaults():
    from pagedserve.server.options import ServeOptions
    from pagedserve.server.serve_cli import _api_key

    d = ServeOptions()
    args = _parse()
    assert args.max_waiting_requests == d.max_waiting_requests == 1024
    assert args.keep_alive_timeout == 15 and args.body_timeout == 30
    assert args.request_timeout == 600 and args.sse_write_timeout == 30
    assert int(args.max_body_mb * 2**20) == d.max_body_bytes == 4 * 2**20
    assert args.max_stop_length == 512 and args.max_logit_bias == 300
    assert args.exit_on_engine_death is True
    assert _parse("--no-exit-on-engine-death").exit_on_engine_death is False
    assert _parse("--request-timeout", "none").request_timeout is None
    assert _api_key(_parse("--api-key", "k1")) == "k1"


def test_api_key_file(tmp_path):
    from pagedserve.server.serve_cli import _api_key

    f = tmp_path / "key"
    f.write_text("s3cret-key\n")
    assert _api_key(_parse("--api-key-file", str(f))) == "s3cret-key"
    f.write_text("\n")
    with pytest.raises(SystemExit, match="empty"):
        _api_key(_parse("--api-key-file", str(f)))
    with pytest.raises(SystemExit, match="cannot read"):
        _api_key(_parse("--api-key-file", str(tmp_path / "missing")))
    with pytest.raises(SystemExit, match="only one"):
        _api_key(_parse("--api-key-file", str(f), "--api-key", "x"))


def test_exposed_without_key_warns(caplog):
    from pagedserve.server.options import ServeOptions
    from pagedserve.server.runner import warn_if_exposed

    with caplog.at_level("WARNING", logger="pagedserve.server"):
        warn_if_exposed(ServeOptions(host="127.0.0.1"))
        warn_if_exposed(ServeOptions(host="0.0.0.0", api_key="k"))
        assert not caplog.records
        warn_if_exposed(ServeOptions(host="0.0.0.0"))
    (rec,) = caplog.records
    assert "0.0.0.0 without an API key" in rec.getMessage()


def test_allowed_origins_flag():
    from pagedserve.server.serve_cli import run

    assert _parse().allowed_origins == "*"
    with pytest.raises(SystemExit, match="'example.com' is not an origin"):
        run(_parse("--allowed-origins", "https://a.example,example.com"))
