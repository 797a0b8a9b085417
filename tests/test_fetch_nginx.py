"""A worker takes its checkpoint over HTTP from a real server: Debian's nginx serving a sharded
checkpoint folder as static files. A ``python -m worker --model http://...`` killed midway
resumes and fetches only what it lacked; it joins a hub and a backbone's decode through it is
identical to the local one; nginx's access log shows the bytes served stayed within 1.05 x the
slice's bytes plus the headers and the small files."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import time

import pytest
from helpers import wait_until

from kvasir.swarm import LocalSwarm, free_port

pytestmark = pytest.mark.integration

SPEC = "*:0-3"
BASE_PATH = "/org/repo/resolve/main/"
SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
               "model.safetensors.index.json")


def find_nginx() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


def start_static_nginx(sw: LocalSwarm, nginx: str, model: pathlib.Path, blocked: str, block_flag: pathlib.Path) -> int:
    """nginx serving ``model`` at BASE_PATH (through a symlink under its root), its access log
    (status, bytes, Range) in ``sw.logs/access.log``; while ``block_flag`` exists, the data
    ranges (not the header's, at bytes 0 and 8) of shard ``blocked`` answer 503."""
    port = free_port()  # nginx cannot bind port 0 and say which it got
    root = sw.workdir / "static"
    www = root / "www"
    (www / BASE_PATH.strip("/")).parent.mkdir(parents=True)
    (www / BASE_PATH.strip("/")).symlink_to(model, target_is_directory=True)
    conf = root / "nginx.conf"
    # As root, nginx's workers would run as nobody and could not read a private temp folder.
    user = "user root;" if os.geteuid() == 0 else ""
    conf.write_text(f"""daemon off;
worker_processes 1;
{user}
pid {root}/nginx.pid;
error_log {sw.logs}/static-error.log warn;
events {{ worker_connections 256; }}
http {{
    log_format bytes '$status $bytes_sent $body_bytes_sent "$http_range" "$request"';
    access_log {sw.logs}/access.log bytes;
    client_body_temp_path {root}/body; proxy_temp_path {root}/proxy; fastcgi_temp_path {root}/fcgi;
    uwsgi_temp_path {root}/uwsgi; scgi_temp_path {root}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {www};
        location = {BASE_PATH}{blocked} {{
            set $b "";
            if ($http_range !~ "^bytes=(0|8)-") {{ set $b "data"; }}
            if (-f {block_flag}) {{ set $b "${{b}}+blocked"; }}
            if ($b = "data+blocked") {{ return 503; }}
        }}
    }}
}}
""")
    sw._spawn("static", ["-p", str(root), "-c", str(conf), "-e", str(sw.logs / "static-error.log")], program=nginx)
    return sw._wait_listening("static", port, 30.0, "nginx")


def access_log(sw: LocalSwarm) -> list[tuple[int, int, str, str]]:
    """(status, body bytes, Range, request) of every request nginx logged."""
    out = []
    text = (sw.logs / "access.log").read_text()
    for line in text[:text.rfind("\n") + 1].splitlines():  # whole lines only: nginx may be writing one
        m = re.fullmatch(r'(\d+) (\d+) (\d+) "([^"]*)" "([^"]*)"', line)
        assert m, line
        out.append((int(m[1]), int(m[3]), m[4] if m[4] != "-" else "", m[5]))
    return out


def test_a_worker_fetches_only_its_slice_from_nginx_resumes_and_serves_exact(tmp_path):
    nginx = find_nginx()
    if nginx is None:
        pytest.skip("nginx not found: install Debian's nginx (apt-get install nginx-light; make system-deps does)")
    from test_fetch import check_slice, slice_spans

    from kvasir.families import make_family_checkpoint

    model = make_family_checkpoint(tmp_path / "model", "qwen3_moe", dtype="bfloat16", shard="100KB")
    spans = slice_spans(model, {layer: {0, 1, 2, 3} for layer in range(3)})
    slice_bytes = sum(b - a for v in spans.values() for a, b in v)
    shards = sorted(model.glob("model-*.safetensors"))
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in shards)
    small = sum((model / name).stat().st_size for name in SMALL_FILES if (model / name).exists())
    blocked = sorted(spans)[len(spans) // 2]  # a shard in the middle of the fetch
    block_flag = tmp_path / "block"
    block_flag.touch()
    cache = tmp_path / "cache"
    with LocalSwarm(tmp_path / "swarm") as sw:
        port = start_static_nginx(sw, nginx, model, blocked, block_flag)
        url = f"http://127.0.0.1:{port}{BASE_PATH}"
        sw.start_hub(extra=["--model", str(model)])
        # The first worker is killed (SIGKILL) while it waits to retry the blocked shard's 503.
        t0 = time.monotonic()
        sw.start_worker("killed", url, SPEC, extra=["--cache-dir", str(cache)])
        wait_until(lambda: (sw.logs / "access.log").exists() and any(s == 503 for s, *_ in access_log(sw)),
                   60.0, "a 503 in nginx's access log")
        sw.stop_process("killed", sig=signal.SIGKILL)
        first = access_log(sw)
        [folder] = cache.iterdir()
        journal = json.loads((folder / ".kvasir-fetch.json").read_text())
        done_before = sum(b - a for ranges in journal["done"].values() for a, b in ranges)
        assert 0 < done_before < slice_bytes and not journal["done"].get(blocked)
        # Unblocked: a new start fetches the rest, and no header again.
        block_flag.unlink()
        sw.start_worker("fetched", url, SPEC, extra=["--cache-dir", str(cache)])
        sw.start_worker("local", model, "*:4-7")
        sw.wait_sessions(2, watch=["fetched", "local"])
        fetch_s = time.monotonic() - t0
        second = access_log(sw)[len(first):]
        result = sw.run_backbone(["--model", str(model), "--prompt", "experts over http", "--batch", "2",
                                  "--max-new-tokens", "10", "--compare-local", "--wait-sessions", "2", "--json"])
        assert result["backbone_exit_code"] == 0, result
        assert result["tokens_identical"] is True and result["max_abs_logit_diff"] == 0.0
        assert result["local_rows"] == 0 and result["remote_rows"] > 0 and result["sessions_quarantined"] == []
        worker_log = (sw.logs / "fetched.log").read_text()
    check_slice(folder, model)

    def is_data(rng: str) -> bool:
        return bool(rng) and not rng.startswith(("bytes=0-", "bytes=8-"))

    reused = int(re.search(r'"bytes_reused": (\d+)', worker_log)[1])  # type: ignore[index]
    assert reused == done_before
    data_first = sum(n for s, n, rng, _ in first if s == 206 and is_data(rng))
    data_second = sum(n for s, n, rng, _ in second if s == 206 and is_data(rng))
    assert data_second == slice_bytes - done_before  # only the missing ranges
    assert not [r for s, n, rng, r in second if rng and not is_data(rng)]  # the headers came from the cache
    served = sum(n for _, n, _, _ in first + second)
    errors = sum(n for s, n, _, _ in first + second if s >= 400)  # 404s of absent tokenizer files, the 503s
    allowed = 1.05 * slice_bytes + headers + 2 * small + errors  # the small files are read again on the restart
    print(f"\nslice {slice_bytes} B; nginx served {served} B in {len(first) + len(second)} requests "
          f"(tensor ranges {data_first + data_second} B = {(data_first + data_second) / slice_bytes:.3f} x the slice; "
          f"headers {headers} B; small files {small} B per start; error bodies {errors} B); "
          f"resumed with {done_before} B cached; "
          f"all served / slice = {served / slice_bytes:.3f}; fetch, kill and resume in {fetch_s:.1f} s")
    assert data_first + data_second <= 1.05 * slice_bytes
    assert served <= allowed, (served, allowed)
