"""The README's "Running the pieces yourself" sequence, run as written (the venv's path put
in) by bash in a fresh folder: keys, a ledger, a hub, two --experts auto workers, a decode
compared with a local run, and a credited balance. If the README's commands drift from what
the programs take, this fails."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sequence() -> str:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- readme-pieces:start -->\n```sh\n(.*?)```\n<!-- readme-pieces:end -->", text, re.S)
    assert block is not None, "the README's marked sequence is missing"
    return block[1].replace("/path/to/kvasir-rpc", str(ROOT))


def test_the_readme_sequence_ends_with_a_decode_and_a_credited_balance(tmp_path):
    script = "set -e\n" + _sequence()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVASIR_", "VIRTUAL_ENV"))}
    # Its own process group: whatever the sequence leaves running (a failed step skips its
    # kill) ends with the test.
    proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=420)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "tokens identical to local: True" in out, out[-4000:]
    credited = re.search(r"([0-9.]+) KVR", done.stdout)
    assert credited is not None and float(credited[1]) > 0, out[-4000:]
    assert oct(os.stat(tmp_path / ".kvasir").st_mode & 0o777) == "0o700"
