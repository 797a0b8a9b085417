"""``kvasir demo --stay`` (issue 30): after the verdict the swarm keeps running with a backbone
service and its OpenAI API, and says how to call it and attach more; SIGTERM stops all of it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from helpers import wait_until

pytestmark = pytest.mark.integration


def test_demo_stay_keeps_the_service_up_says_how_to_use_it_and_stops_whole(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvasir", "demo", "--stay", "--path", "hub"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line)
            if "--experts auto --wallet" in line:  # the last line of the how-to
                break
        text = "".join(lines)
        assert "VERDICT: remote decode is bitwise identical to local" in text, text[-3000:]
        openai = re.search(r"curl (http://127\.0\.0\.1:\d+/v1)/completions", text)
        model = re.search(r'"model": "([^"]+)"', text)
        assert openai and model and "grpcurl -plaintext" in text and "--hub-token-file" in text, text[-3000:]
        body = json.dumps({"model": model[1], "prompt": "Hello", "max_tokens": 4}).encode()
        request = urllib.request.Request(openai[1] + "/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.load(answer)["usage"]["completion_tokens"] == 4
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) is not None

        def group() -> list[str]:
            return subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()

        # Every piece it started is gone with it (the process group holds no one).
        wait_until(lambda: not group(), 30, "the demo's processes to end with it")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
