"""--compare-local's two passing verdicts and the failing one (issue 29: an honest worker on other
hardware passes with the same tokens; --require-bitwise keeps the one-machine check)."""

from __future__ import annotations

import pytest

import backbone.cli as cli
import backbone.cli._generate as generate


@pytest.mark.parametrize("result,want", [
    ({"tokens_identical": True, "max_abs_logit_diff": 0.0}, generate.BITWISE),
    ({"tokens_identical": True, "max_abs_logit_diff": 9.5e-7}, generate.WITHIN_BOUND),
    ({"tokens_identical": False, "max_abs_logit_diff": 0.0}, generate.TOKENS_DIFFER),
    ({"tokens_identical": False, "max_abs_logit_diff": float("inf")}, generate.TOKENS_DIFFER),
])
def test_the_verdict_of_a_comparison(result, want):
    assert generate.verdict(result) == want


def test_require_bitwise_needs_compare_local(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "--model", str(tmp_path), "--prompt", "x", "--require-bitwise"])
    assert exc.value.code == 2
    assert "--require-bitwise judges --compare-local" in capsys.readouterr().err
