"""benchmarks/train_step_profile.py's --setting parser: the one part of that GPU benchmark a CPU can check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import train_step_profile as profile  # noqa: E402


def test_a_setting_takes_json_values_and_bare_words():
    name, fields = profile.parse_setting("normed:recipe=normed,norm_output=false,lr=2e-3,batch_tokens=8192")
    assert name == "normed" and fields == {"recipe": "normed", "norm_output": False, "lr": 2e-3, "batch_tokens": 8192}
    assert profile.parse_setting("default") == ("default", {})
    with pytest.raises(SystemExit, match="unknown TrainConfig field 'ttt'"):
        profile.parse_setting("x:ttt=3")
