"""Ending a decode early: Ctrl-C (SIGINT) or --max-seconds stop it after the current step,
the tokens so far are the result, and --compare-local compares exactly that many.

Integration: loads a real transformers model and runs the real backbone CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from helpers import wait_until

from backbone.engine._decode import decode, decode_grouped, load_model, prompts_for_batch

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def qwen3(tiny_models):  # type: ignore[no-untyped-def]
    return load_model(tiny_models("qwen3_moe"))


def test_a_set_stop_ends_every_group_at_the_same_step(qwen3) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = qwen3
    prompts = prompts_for_batch("stop", 4)
    full = decode_grouped(model, tokenizer, prompts, 6, 2, implementation="eager")
    stop = threading.Event()
    stop.set()  # before the first step: one token each
    cut = decode_grouped(model, tokenizer, prompts, 6, 2, implementation="eager", stop=stop)
    assert cut.new_tokens.shape == (4, 1)
    assert torch.equal(cut.new_tokens, full.new_tokens[:, :1])
    assert torch.equal(cut.logits, full.logits[:1])
    one = decode(model, tokenizer, prompts, 6, implementation="eager", stop=stop)
    assert one.new_tokens.shape == (4, 1)


def _backbone(model, *args: str, stderr) -> subprocess.Popen[bytes]:  # type: ignore[no-untyped-def]
    return subprocess.Popen([sys.executable, "-m", "backbone", "generate", "--model", str(model), "--prompt", "stop",
                             "--max-new-tokens", "100000", "--compare-local", "--json", "--log-level", "info", *args],
                            stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                            env={**os.environ, "KVASIR_THREADS": "1"})


def _result(proc: subprocess.Popen[bytes], timeout: float = 120) -> dict[str, object]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out[-2000:]
    result: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def test_max_seconds_ends_the_decode_and_compares_what_was_decoded(tiny_models, tmp_path) -> None:
    with open(tmp_path / "err.log", "wb") as err:
        result = _result(_backbone(tiny_models("qwen3_moe"), "--max-seconds", "0.5", stderr=err))
    assert result["stopped_early"] is True
    assert 1 <= int(result["steps"]) < 100000  # type: ignore[call-overload]
    assert result["n_tokens"] == result["steps"]
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0


def test_ctrl_c_ends_the_decode_and_compares_what_was_decoded(tiny_models, tmp_path) -> None:
    log = tmp_path / "err.log"
    with open(log, "wb") as err:
        proc = _backbone(tiny_models("qwen3_moe"), stderr=err)
        try:
            # "decoding" is logged once the Ctrl-C handler is in place: from then on Ctrl-C ends the decode.
            wait_until(lambda: b"decoding" in log.read_bytes() or proc.poll() is not None, 120, "the decode to start")
            proc.send_signal(signal.SIGINT)
            result = _result(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert b"stopping after this step" in log.read_bytes()
    assert result["stopped_early"] is True and int(result["steps"]) >= 1  # type: ignore[call-overload]
    assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
