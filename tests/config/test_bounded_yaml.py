"""Config files are parsed in bounded memory: size and node caps, no repeated keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from reco_megatron.config import ConfigError, load_config, loader, read_yaml
from reco_megatron.config.bounded_yaml import MAX_BYTES, MAX_NODES, load_bounded
from reco_megatron.trainer.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _alias_bomb(levels: int = 9, width: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_before_it_expands(tmp_path):
    # 9 levels of 9 aliases: 9**9 values once copied (hung at 1.7 GB before the cap)
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    with pytest.raises(ConfigError, match="RECO_CONFIG_MAX_NODES") as err:
        read_yaml(path)
    assert "alias bomb" in str(err.value)


def test_alias_bomb_in_an_override_is_refused():
    anchors = "[&a [1, 1, 1, 1, 1, 1, 1, 1], " + ", ".join(["*a"] * 20000) + "]"
    with pytest.raises(ConfigError, match="RECO_CONFIG_MAX_NODES"):
        load_config(TrainConfig, None, [f"trainer.tags={anchors}"])


def test_the_node_cap_can_be_raised(monkeypatch, tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text(_alias_bomb(levels=4, width=10))  # ~11k values: under the default
    assert len(read_yaml(path)["a3"]) == 10
    monkeypatch.setenv("RECO_CONFIG_MAX_NODES", "1000")
    with pytest.raises(ConfigError, match="more than 1000 values"):
        read_yaml(path)
    monkeypatch.setenv("RECO_CONFIG_MAX_NODES", "lots")
    with pytest.raises(ConfigError, match="RECO_CONFIG_MAX_NODES='lots' must be a positive"):
        read_yaml(path)


def test_large_file_is_refused_unread(monkeypatch, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (MAX_BYTES + 10) + "\n")
    taken: list[int] = []  # bytes handed out by every read of the file
    real_open = Path.open

    def counting_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        read = f.read

        def counted(*a):
            data = read(*a)
            taken.append(len(data))
            return data

        f.read = counted
        return f

    def not_parsed(text, **_):
        raise AssertionError("an oversized file reached the YAML parser")

    with monkeypatch.context() as m:
        m.setattr(Path, "open", counting_open)
        m.setattr(loader, "load_bounded", not_parsed)
        with pytest.raises(ConfigError, match=r"larger than 1048576 bytes.*RECO_CONFIG_MAX_BYTES"):
            read_yaml(path)
    assert sum(taken) == MAX_BYTES + 1  # one byte past the cap tells; the rest stays unread
    monkeypatch.setenv("RECO_CONFIG_MAX_BYTES", str(4 * MAX_BYTES))
    assert read_yaml(path) == {}


def test_duplicate_top_level_key_names_both_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("trainer:\n  seed: 7\nloss:\n  eps_high: 0.2\ntrainer:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"key 'trainer' appears twice .*line 1 and line 5"):
        load_config(TrainConfig, path)


def test_duplicate_nested_key_is_refused():
    with pytest.raises(ConfigError, match=r"'seed' appears twice .*line 1 and line 1"):
        load_bounded("{seed: 1, seed: 2}")


def test_merge_keys_and_shared_aliases_still_load():
    text = "base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\nlist: [*b, *b]\n"
    assert load_bounded(text) == {
        "base": {"x": 1, "y": 2},
        "other": {"x": 1, "y": 3},
        "list": [{"x": 1, "y": 2}, {"x": 1, "y": 2}],
    }


def test_recursive_alias_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_bounded("a: &a [*a]")
    assert str(err.value).splitlines() == ["the config refers to itself (a recursive YAML alias)"]
    path = tmp_path / "loop.yaml"  # from a file: one problem under the file's name
    path.write_text("a: &a [*a]\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert err.value.problems == ("the config refers to itself (a recursive YAML alias)",)


def test_every_shipped_config_is_far_below_the_caps():
    configs = sorted(REPO.glob("examples/**/*.yaml")) + sorted(REPO.glob("tests/**/*.yaml"))
    assert configs
    for path in configs:
        assert path.stat().st_size * 50 < MAX_BYTES, path
        load_bounded(path.read_text(encoding="utf-8"), max_nodes=MAX_NODES // 50)
