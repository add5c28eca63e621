"""``reco-eval`` defaults that fit the model, and a plot where identical curves stay visible."""

from __future__ import annotations

import pytest

from reco_megatron.eval.pipeline import EvalSettings, fit_max_new_tokens
from reco_megatron.eval.report import curve_styles


def _settings(**kw) -> EvalSettings:
    return EvalSettings(checkpoints=[("a", "x")], data="d.jsonl", out_dir="o", **kw)


def test_response_length_fits_the_context() -> None:
    # The case: 70-token prompts, context 128: 64 did not fit, 58 does.
    assert fit_max_new_tokens(_settings(), 70, [128]) == 58
    assert fit_max_new_tokens(_settings(), 20, [128, 512]) == 64  # the cap
    assert fit_max_new_tokens(_settings(), 20, []) == 64  # context unknown
    assert fit_max_new_tokens(_settings(max_new_tokens=24), 70, [128]) == 24
    with pytest.raises(ValueError, match=r"--max-new-tokens 64 \+ the longest prompt .* 58"):
        fit_max_new_tokens(_settings(max_new_tokens=64), 70, [128])
    with pytest.raises(ValueError, match="no room for a response"):
        fit_max_new_tokens(_settings(), 128, [128])


def test_identical_curves_get_distinct_styles_and_a_note() -> None:
    a = {"pass@1": 0.25, "pass@2": 0.5}
    b = {"pass@1": 0.25, "pass@2": 0.5}
    c = {"pass@1": 0.3, "pass@2": 0.5}
    styles = curve_styles([a, b, c], ["ckpt", "hf export", "other"])
    assert [s["label"] for s in styles] == ["ckpt", "hf export (= ckpt)", "other"]
    assert (styles[0]["marker"], styles[0]["linestyle"]) != (
        styles[1]["marker"],
        styles[1]["linestyle"],
    )
    assert styles[2]["marker"] == styles[0]["marker"]


def test_answer_key_defaults_to_the_rewards_builtin_and_can_be_switched_off() -> None:
    assert _settings(reward="countdown").answer_key_spec().endswith(":countdown_answer_key")
    assert _settings(reward="math").answer_key_spec() == ""
    assert _settings(reward="countdown", answer_key="none").answer_key_spec() == ""
    assert _settings(answer_key="pkg.mod:key").answer_key_spec() == "pkg.mod:key"
    assert _settings(reward="countdown").protocol()["answer_key"].endswith("answer_key")
