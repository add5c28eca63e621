"""``checkpoint.hf_converter``: when Megatron-Bridge is used, and how the adapter calls it.

Selection logic and the calling contract run everywhere with a stand-in ``AutoBridge``; the
bridge's real conversion is compared with ours in ``test_bridge_crosscheck.py``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from reco_megatron.megatron.hf import bridge
from reco_megatron.megatron.hf.bridge import bridge_hf_weights, bridge_load_hf
from reco_megatron.megatron.hf.convert import WeightMappingError
from reco_megatron.megatron.hf.converter import choose_converter
from reco_megatron.megatron.model.config import ModelConfig

UNPADDED = ModelConfig(vocab_size=128, make_vocab_size_divisible_by=64)
PADDED = ModelConfig(vocab_size=100, make_vocab_size_divisible_by=64)


@pytest.fixture
def importable(monkeypatch):
    monkeypatch.setattr(bridge, "bridge_import_error", lambda: None)


@pytest.fixture
def missing(monkeypatch):
    monkeypatch.setattr(
        bridge, "bridge_import_error", lambda: "ModuleNotFoundError: megatron.bridge"
    )


def _choose(setting, cfg=UNPADDED, **kw):
    args = dict(tp=1, pp=1, on_gpu=False, importing=False) | kw
    return choose_converter(setting, cfg, **args)


def test_builtin_never_looks_for_the_bridge(missing) -> None:
    assert _choose("builtin").name == "builtin"


def test_auto_falls_back_with_the_reason(missing) -> None:
    choice = _choose("auto")
    assert choice.name == "builtin" and "not importable (ModuleNotFoundError" in choice.reason


@pytest.mark.parametrize(
    ("cfg", "kw", "reason"),
    [
        (PADDED, {}, r"vocabulary is padded \(100 -> 128 at TP 1\)"),
        (UNPADDED, {"tp": 4}, r"padded \(128 -> 256 at TP 4\)"),
        (ModelConfig(vocab_size=256), {"tp": 2, "importing": True}, "needs CUDA"),
        (ModelConfig(vocab_size=128, tie_word_embeddings=True), {"pp": 2}, "tied embeddings"),
        (UNPADDED, {"vpp": 2}, "virtual pipelines"),
    ],
)
def test_auto_keeps_ours_outside_the_verified_range(importable, cfg, kw, reason) -> None:
    choice = _choose("auto", cfg, **kw)
    assert choice.name == "builtin"
    assert pytest.importorskip("re").search(reason, choice.reason), choice.reason
    with pytest.raises(ValueError, match="cannot give the right tensors here"):
        _choose("megatron_bridge", cfg, **kw)


def test_auto_uses_the_bridge_inside_it(importable) -> None:
    assert _choose("auto").name == "megatron_bridge"
    assert _choose("auto", ModelConfig(vocab_size=256), tp=2, importing=True, on_gpu=True).name == (
        "megatron_bridge"
    )
    assert _choose("megatron_bridge").name == "megatron_bridge"


def test_forced_bridge_that_does_not_import_says_what_to_do(missing) -> None:
    with pytest.raises(RuntimeError, match=r"does not import .*hf_converter=builtin"):
        _choose("megatron_bridge")
    with pytest.raises(ValueError, match=r"one of \('auto', 'builtin', 'megatron_bridge'\)"):
        _choose("bridge")


def test_config_field_validated_on_load(tmp_path) -> None:
    from reco_megatron.config import load_config
    from reco_megatron.trainer.config import TrainConfig

    out = f"trainer.output_dir={tmp_path}"
    cfg = load_config(TrainConfig, "examples/tiny_cpu.yaml", [out])
    assert cfg.checkpoint.hf_converter == "auto"
    with pytest.raises(Exception, match="megatron_bridge"):
        load_config(TrainConfig, "examples/tiny_cpu.yaml", [out, "checkpoint.hf_converter=mb"])


class _FakeAutoBridge:
    calls: ClassVar[list] = []

    def __init__(self, source):
        self.source = source

    @classmethod
    def from_hf_config(cls, config):
        cls.calls.append(("from_hf_config", config))
        return cls(config)

    @classmethod
    def from_hf_pretrained(cls, path):
        cls.calls.append(("from_hf_pretrained", path))
        return cls(path)

    def export_hf_weights(self, model, **kw):
        self.calls.append(("export_hf_weights", model, kw))
        yield "model.embed_tokens.weight", torch.ones(2)
        yield "lm_head.weight", torch.ones(2)

    def load_hf_weights(self, model):
        self.calls.append(("load_hf_weights", model))


@pytest.fixture
def fake_bridge(monkeypatch):
    mod = types.ModuleType("megatron.bridge")
    mod.AutoBridge = _FakeAutoBridge
    _FakeAutoBridge.calls = []
    monkeypatch.setitem(sys.modules, "megatron.bridge", mod)
    return _FakeAutoBridge


@pytest.mark.parametrize("tied", [False, True])
def test_export_stream_calls_and_tied_head(fake_bridge, tied) -> None:
    cfg = ModelConfig(vocab_size=128, tie_word_embeddings=tied)
    chunk = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace()))
    names = [n for n, _ in bridge_hf_weights([chunk], cfg)]
    assert names == (
        ["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.weight"]
    )
    assert chunk.module.config.share_embeddings_and_output_weights is tied
    (_, hf_config), (_, model, kw) = fake_bridge.calls
    assert hf_config.model_type == "llama" and hf_config.vocab_size == 128
    assert hf_config.architectures == ["LlamaForCausalLM"]
    assert model == [chunk]
    assert kw == {"cpu": False, "show_progress": False, "merge_adapter_weights": False}


def test_bridge_import_runs_our_checks_first(fake_bridge, tmp_path) -> None:
    from reco_megatron.megatron.hf.config import model_config_from_hf
    from tests.megatron.test_convert import build_hf

    model = build_hf("llama")
    model.save_pretrained(tmp_path)
    cfg = model_config_from_hf(tmp_path)
    chunk = SimpleNamespace(config=SimpleNamespace())
    bridge_load_hf(tmp_path, [chunk], cfg)
    assert fake_bridge.calls == [
        ("from_hf_pretrained", str(tmp_path)),
        ("load_hf_weights", [chunk]),
    ]
    # A tensor missing from the checkpoint: our check names it; the bridge is never called
    # (it would skip the tensor with a warning and keep the random init).
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fake_bridge.calls = []
    with pytest.raises(WeightMappingError, match=r"lacks 1 tensor.*layers\.1\.mlp\.down_proj"):
        bridge_load_hf(tmp_path, [chunk], cfg)
    assert fake_bridge.calls == []
    other = model_config_from_hf(tmp_path, make_vocab_size_divisible_by=64)
    with pytest.raises(ValueError, match="does not match the model config"):
        bridge_load_hf(tmp_path, [chunk], ModelConfig(**{**other.__dict__, "num_layers": 3}))


def test_bridge_import_error_is_a_reason_not_a_crash() -> None:
    reason = bridge.bridge_import_error()
    assert reason is None or reason.split(":")[0].endswith(("Error", "Exception"))


def test_a_quiet_import_drops_info_keeps_warnings_and_restores_root_logging(capsys) -> None:
    import logging

    from reco_megatron.utils.logging import quiet_third_party_import

    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    library = logging.getLogger("some_library.import_utils")
    with quiet_third_party_import():
        # What megatron.training does on import: its own handler on the root, INFO and up.
        root.addHandler(logging.StreamHandler(sys.stdout))
        root.setLevel(logging.INFO)
        library.info("Import of X failed with: Traceback (most recent call last): ...")
        library.warning("this one the user should see")
    library.info("and after the block, the root is as it was")
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "as it was" not in out
    assert "this one the user should see" in out
    assert (list(root.handlers), root.level) == before
    assert logging.root.manager.disable == logging.NOTSET


@pytest.mark.bridge
@pytest.mark.dist
def test_probing_the_real_bridge_prints_nothing_and_leaves_logging_alone() -> None:
    """Megatron-Bridge 0.6.2 with transformers >= 5.25 logs a traceback at INFO while importing
    and configures the root logger (``megatron.training``); a run only asks whether it imports."""
    import os
    import subprocess

    from tests.megatron._bridge_shim import ENV

    code = (
        "import logging\n"
        "from tests.megatron._bridge_shim import install\n"
        "install(probe=False)\n"
        "from reco_megatron.megatron.hf.bridge import bridge_import_error\n"
        "reason = bridge_import_error()\n"
        "root = logging.getLogger()\n"
        "print('RESULT', reason, root.handlers, logging.getLevelName(root.level))\n"
    )
    if not os.environ.get(ENV):
        try:
            import megatron.bridge  # noqa: F401
        except Exception as err:
            pytest.skip(f"Megatron-Bridge does not import here and ${ENV} is unset ({err})")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    (result,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert result.endswith("[] WARNING"), result
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
