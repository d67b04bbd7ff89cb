from pathlib import Path

import pytest

from queue_schemas.config import ConfigError, load_config, parse_config


def test_packaged_default_has_a_simulated_pool() -> None:
    cfg = load_config(None)
    assert cfg.pool_for_model("sluice-sim") is not None
    assert cfg.pool("sim").engine == "simulated"


def test_duplicate_models_are_refused() -> None:
    text = '[[pools]]\nname = "a"\nmodel = "m"\n[[pools]]\nname = "b"\nmodel = "m"\n'
    with pytest.raises(ConfigError, match="repeated: m"):
        parse_config(text)


def test_unknown_keys_and_bad_toml_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replicaz"):
        parse_config('[[pools]]\nname = "a"\nmodel = "m"\nreplicaz = 2\n')
    bad = tmp_path / "pools.toml"
    bad.write_text("[[pools]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


def test_unknown_pool_names_the_configured_ones() -> None:
    with pytest.raises(KeyError, match="configured: sim"):
        load_config(None).pool("nope")
