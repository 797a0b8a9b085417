"""Errors a person can act on, from the hub, the gateway and the ledger.

Each mistake the operator must fix before starting again ends the command with ONE line on
stderr (no traceback) that names the flag and the fix, and exit status 2: an untrusted
gateway certificate, a gateway refusing the hub's token (401, which the gateway also logs
at warning with the peer's address), missing or bad token, key and CA files, a port in use
or needing privileges, a bogus --log-level. What retrying can mend (a gateway not running)
is retried, with a warning per attempt naming the gateway. ``--help`` shows every argument
with its help and default, and state files default under ``.kvasir/`` (mode 0700).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import pwd
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from helpers import ROOT, taken_port, wait_until

from kvasir.swarm import LocalSwarm, free_port
from kvasir_rpc import BACKBONE_TOKEN_FILE, STATE_DIR, HelpFormatter, Wallet

RUN_TIMEOUT_S = 60  # a cold interpreter importing grpc on a busy 2-core machine, with room
TOKEN = "t" * 40


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))


def _run(args: list[str], *, cwd: pathlib.Path = ROOT, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=cwd,
                          stdin=subprocess.DEVNULL, env=_env(), **kw)  # type: ignore[call-overload]


def _one_line(out: subprocess.CompletedProcess[str], status: int = 2) -> str:
    """The single line on stderr, checked: the exit status, nothing else printed, no traceback."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == status, out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def _hub(tmp: pathlib.Path, *extra: str) -> list[str]:
    return ["-m", "relay", "hub", "--listen", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--key", str(tmp / "hub.key"),
            "--backbone-token-file", str(tmp / "backbone.token"), "--contrib-db", str(tmp / "contrib.sqlite"), *extra]


def _token_file(path: pathlib.Path, text: str = TOKEN) -> pathlib.Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


# -- the hub and its gateway -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSwarm]:
    """One TLS gateway (LocalSwarm's dev CA) for the tests of the hub's link to it."""
    with LocalSwarm(tmp_path_factory.mktemp("gateway")) as sw:
        sw.start_gateway()
        yield sw


def _gateway_log(sw: LocalSwarm) -> list[dict[str, object]]:
    lines = (sw.logs / "gateway.log").read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


@pytest.mark.integration
def test_a_contrib_db_that_is_not_a_hub_database_stops_the_hub_in_one_line(tmp_path: pathlib.Path) -> None:
    """A careless operator points --contrib-db at some other file: the hub says which file and
    what to do, exit status 2, no traceback, and leaves the file as it was."""
    junk = tmp_path / "contrib.sqlite"
    junk.write_bytes(b"this is a spreadsheet, not a database\n" * 64)
    before = junk.read_bytes()
    line = _one_line(_run(_hub(tmp_path)))
    assert line.startswith("hub: --contrib-db: ") and str(junk) in line, line
    assert line.endswith("point --contrib-db at this hub's database, or at a new path to start one"), line
    assert junk.read_bytes() == before


@pytest.mark.integration
def test_a_gateway_certificate_not_trusted_stops_the_hub_naming_ca_file(tls_gateway: LocalSwarm,
                                                                        tmp_path: pathlib.Path) -> None:
    out = _run(_hub(tmp_path, "--gateway", tls_gateway.gateway_url, "--gateway-token-file",
                    str(tls_gateway.token_file)))
    line = _one_line(out)
    assert line.startswith(f"hub: the gateway at {tls_gateway.gateway_url} presented a certificate this machine "
                           "does not trust ("), line
    assert line.endswith("): pass --ca-file with its CA (kvasir certs writes ca.pem)"), line


@pytest.mark.integration
def test_a_refused_hub_token_stops_the_hub_and_the_gateway_warns_with_the_peer(tls_gateway: LocalSwarm,
                                                                                tmp_path: pathlib.Path) -> None:
    wrong = _token_file(tmp_path / "wrong.token", "w" * 40)
    out = _run(_hub(tmp_path, "--gateway", tls_gateway.gateway_url, "--gateway-token-file", str(wrong),
                    "--ca-file", str(tls_gateway.ca_file)))
    assert _one_line(out) == (f"hub: the gateway at {tls_gateway.gateway_url} refused this hub's token (401): "
                              "--gateway-token-file must hold the token the gateway reads from its --hub-token-file")
    refused = [e for e in _gateway_log(tls_gateway) if e.get("reason") == "hub_token"]
    assert refused and all(e["level"] == "warning" for e in refused), refused
    assert str(refused[-1]["remote"]).startswith("127.0.0.1:") and "--hub-token-file" in str(refused[-1]["hint"])


@pytest.mark.integration
def test_a_gateway_not_running_is_retried_with_a_warning_naming_it(tmp_path: pathlib.Path) -> None:
    url = f"ws://127.0.0.1:{free_port()}"
    ready = tmp_path / "ready.json"
    log = tmp_path / "hub.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, *_hub(tmp_path, "--gateway", url, "--gateway-token-file",
                                                       str(_token_file(tmp_path / "gw.token")),
                                                       "--ready-file", str(ready))],
                                stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=_env())
    try:
        def warnings() -> list[dict[str, object]]:
            events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            return [e for e in events if e.get("level") == "warning" and e.get("gateway") == url]

        wait_until(lambda: len(warnings()) >= 2 or proc.poll() is not None, 30, "two retries logged")
        assert proc.poll() is None, log.read_text()
        assert ready.exists()  # still serving LAN workers meanwhile
        first = warnings()[0]
        assert "retrying" in str(first["event"]) and "--gateway" in str(first["event"]), first
        assert "Connection refused" in str(first["error"]), first
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()


@pytest.mark.integration
def test_a_hub_stopped_while_a_silent_gateway_has_not_answered_stops_cleanly(tmp_path: pathlib.Path) -> None:
    # The hub says "listening" after its first attempt at the gateway (so that a refusal comes
    # first); a gateway that accepts and never answers holds that attempt for its timeout.
    with taken_port() as port:  # listening, never accepting: the TCP handshake completes, then silence
        proc = subprocess.Popen([sys.executable, *_hub(tmp_path, "--gateway", f"ws://127.0.0.1:{port}",
                                                       "--gateway-token-file", str(_token_file(tmp_path / "t")))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env=_env())
        try:
            wait_until(lambda: (tmp_path / "contrib.sqlite").exists() or proc.poll() is not None, 30, "the hub starting")
            time.sleep(1.0)  # into the first attempt (its connect timeout is 10 s)
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and b"Traceback" not in err, err.decode(errors="replace")
    assert b"hub stopping" in err


# -- files and flags ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["missing", "too short", "a folder"])
def test_the_gateway_names_a_bad_hub_token_file_and_how_to_make_one(tmp_path: pathlib.Path, case: str) -> None:
    path = tmp_path / "hub.token"
    if case == "too short":
        _token_file(path, "short")
    elif case == "a folder":
        path.mkdir()
    out = _run(["-m", "relay", "gateway", "--listen", "127.0.0.1:0", "--insecure-plain-ws",
                "--hub-token-file", str(path)])
    line = _one_line(out)
    assert line.startswith("gateway: --hub-token-file: "), line
    assert line.endswith(f"make one with (umask 077; head -c 32 /dev/urandom | base64 > {path}) and give hubs a "
                         "copy (their --gateway-token-file)"), line


@pytest.mark.parametrize("case, extra, says", [
    ("no token file", ["--gateway", "wss://127.0.0.1:9"],
     "hub: --gateway needs --gateway-token-file: a copy of the file the gateway reads with --hub-token-file"),
    ("missing token file", ["--gateway", "wss://127.0.0.1:9", "--gateway-token-file", "{tmp}/none"],
     "hub: --gateway-token-file: cannot read the token file {tmp}/none: No such file or directory: copy here the "
     "file the gateway reads with --hub-token-file"),
    ("http scheme", ["--gateway", "http://127.0.0.1:9"],
     "hub: --gateway http://127.0.0.1:9: a gateway's address is wss://HOST:PORT (ws:// only behind a TLS "
     "terminator)"),
    ("missing CA", ["--gateway", "wss://127.0.0.1:9", "--gateway-token-file", "{tmp}/gw.token",
                    "--ca-file", "{tmp}/none.pem"],
     "hub: --ca-file {tmp}/none.pem: No such file or directory: give the CA certificate (PEM) that signed the "
     "gateway's certificate (kvasir certs writes ca.pem)"),
    ("short backbone token", ["--backbone-token-file", "{tmp}/short.token"],
     "hub: --backbone-token-file {tmp}/short.token: {tmp}/short.token: a token is at least 16 printable ASCII "
     "characters without spaces: fix or delete the file (a new one is made when missing), or point "
     "--backbone-token-file elsewhere"),
    ("bad key", ["--key", "{tmp}/short.token"],
     "hub: --key {tmp}/short.token: {tmp}/short.token: expected 64 lowercase hex characters (an Ed25519 seed): "
     "point --key at this hub's key file, or at a new path to make one"),
])
def test_the_hub_names_the_flag_of_a_bad_file_or_url(tmp_path: pathlib.Path, case: str, extra: list[str],
                                                     says: str) -> None:
    _token_file(tmp_path / "gw.token")
    _token_file(tmp_path / "short.token", "short")
    out = _run(_hub(tmp_path, *[x.format(tmp=tmp_path) for x in extra]))
    assert _one_line(out) == says.format(tmp=tmp_path)
    assert not (tmp_path / "contrib.sqlite").exists()  # refused before it opened anything


def test_a_busy_port_is_named_with_its_flag(tmp_path: pathlib.Path) -> None:
    # (tests/test_startup.py starts the real first copy of each and checks it keeps answering.)
    with taken_port() as port:
        taken = f"127.0.0.1:{port}"
        hint = "is in use by another program: stop it or choose another port (port 0 picks a free one)"
        runs = {
            f"hub: --grpc {taken}": _hub(tmp_path, "--grpc", taken),
            f"hub: --listen {taken}": _hub(tmp_path, "--listen", taken),
            f"gateway: --listen {taken}": ["-m", "relay", "gateway", "--listen", taken, "--insecure-plain-ws",
                                           "--hub-token-file", str(_token_file(tmp_path / "gw.token"))],
            f"ledger: --listen {taken}": ["-m", "ledger", "serve", "--listen", taken, "--db",
                                          f"sqlite:///{tmp_path / 'ledger.db'}", "--trust-key",
                                          Wallet.generate().address],
        }
        for start, args in runs.items():
            assert _one_line(_run(args)) == f"{start} {hint}"
    assert not (tmp_path / "contrib.sqlite").exists() and not (tmp_path / "ledger.db").exists()


def _unprivileged_user() -> pwd.struct_passwd | None:
    """nobody (or daemon) when that user can run this interpreter; None otherwise (as when
    Python lives under root's own home)."""
    for name in ("nobody", "daemon"):
        with contextlib.suppress(KeyError, OSError, subprocess.SubprocessError):
            user = pwd.getpwnam(name)
            probe = _run(["-c", _AS_USER, str(user.pw_uid), str(user.pw_gid), sys.executable, "-c", "import trio"],
                         cwd=pathlib.Path("/"))
            if probe.returncode == 0:
                return user
    return None


# Run as a launcher: a fresh, single-threaded interpreter drops the privilege and execs the
# command. Dropping it in the test's own process (preexec_fn, or subprocess's user=) forks a
# process that may hold grpc's threads (another test in the same pytest worker started them),
# and grpc's fork handlers could abort the child before it ran (seen once in CI: SIGABRT,
# "epoll_wait error: Bad file descriptor").
_AS_USER = ("import os, sys; uid, gid = int(sys.argv[1]), int(sys.argv[2]); os.setgroups([]); os.setgid(gid); "
            "os.setuid(uid); os.execv(sys.argv[3], sys.argv[3:])")
# Without CAP_NET_BIND_SERVICE in the bounding set (prctl PR_CAPBSET_DROP 24, capability 10):
# a root process holding every privilege but the one that binding port 443 asks for.
_WITHOUT_BIND = ("import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
                 "r = libc.prctl(24, 10, 0, 0, 0); "
                 "r == 0 or sys.exit(f'prctl(PR_CAPBSET_DROP, CAP_NET_BIND_SERVICE): errno {ctypes.get_errno()}'); "
                 "os.execv(sys.argv[1], sys.argv[1:])")


def test_the_gateway_on_its_default_port_as_a_normal_user_says_what_to_do() -> None:
    """Run as an unprivileged user (nobody); as root where no such user can run this Python,
    as root without CAP_NET_BIND_SERVICE, which is what binding port 443 asks for."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="kvasir-443-"))
    try:
        token = _token_file(folder / "hub.token")
        prefix: list[str] = []
        if os.geteuid() == 0:
            user = _unprivileged_user()
            if user is not None:
                # The token in a folder that user owns (tmp_path's parents are root's alone).
                os.chmod(folder, 0o755)
                os.chown(folder, user.pw_uid, user.pw_gid)
                os.chown(token, user.pw_uid, user.pw_gid)
                prefix = ["-c", _AS_USER, str(user.pw_uid), str(user.pw_gid), sys.executable]
            elif sys.platform == "linux":
                prefix = ["-c", _WITHOUT_BIND, sys.executable]
            else:
                pytest.skip("running as root, and no unprivileged user can run this interpreter")
        out = _run([*prefix, "-m", "relay", "gateway", "--insecure-plain-ws", "--hub-token-file", str(token)],
                   cwd=folder)
        if out.returncode == 0 or "needs privileges" not in out.stderr:
            with contextlib.suppress(OSError, ValueError):
                if int(pathlib.Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) <= 443:
                    pytest.skip("this kernel lets anyone listen on port 443 (ip_unprivileged_port_start)")
        assert _one_line(out) == (
            "gateway: --listen 0.0.0.0:443 needs privileges: run as root, grant CAP_NET_BIND_SERVICE "
            "(setcap 'cap_net_bind_service=+ep' on the python binary), or listen on a higher port such as 8443 "
            "behind a proxy that forwards 443")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("command", [["relay", "hub"], ["relay", "gateway", "--hub-token-file", "x"],
                                     ["ledger", "serve", "--trust-key", "0" * 64]], ids=["hub", "gateway", "ledger"])
def test_a_bogus_log_level_is_a_usage_error(command: list[str]) -> None:
    out = _run(["-m", command[0], *command[1:], "--log-level", "bogus"])
    assert out.returncode == 2, out.stderr
    assert "argument --log-level: invalid choice: 'bogus'" in out.stderr


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


@pytest.mark.parametrize("module", ["relay.__main__", "ledger.__main__"])
def test_every_argument_has_help_and_every_parser_shows_defaults(module: str) -> None:
    import importlib

    build = importlib.import_module(module).build_parser
    seen = 0
    for prog, parser in _parsers(build()):
        assert parser.formatter_class is HelpFormatter, prog
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            seen += 1
            assert action.help and action.help != argparse.SUPPRESS, f"{prog} {action.option_strings or action.dest}"
            if action.dest == "log_level":
                assert action.choices is not None and "bogus" not in action.choices
        parser.format_help()  # every help string formats (a stray % would raise here)
    assert seen > 10


# -- state files under .kvasir/ ----------------------------------------------------------------


def _mode(path: pathlib.Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.integration
def test_state_files_default_under_dot_kvasir(tmp_path: pathlib.Path) -> None:
    """The hub's key, backbone token and database, and the ledger's database, go to .kvasir/ of
    the working folder (made 0700); the backbone's --hub-token-file default is the hub's."""
    env = _env()
    procs = {
        "hub": subprocess.Popen([sys.executable, "-m", "relay", "hub", "--listen", "127.0.0.1:0", "--grpc",
                                 "127.0.0.1:0", "--ready-file", "hub.json"], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
        "ledger": subprocess.Popen([sys.executable, "-m", "ledger", "serve", "--listen", "127.0.0.1:0", "--trust-key",
                                    Wallet.generate().address, "--ready-file", "ledger.json"], cwd=tmp_path, env=env,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
    }
    try:
        wait_until(lambda: all((tmp_path / f"{n}.json").exists() or p.poll() is not None for n, p in procs.items()),
                   60, "the hub and the ledger listening")
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        errors = {name: proc.communicate(timeout=30)[1].decode(errors="replace") for name, proc in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), errors
    state = tmp_path / STATE_DIR
    assert _mode(state) == 0o700
    assert sorted(p.name for p in state.iterdir()) == ["hub-backbone.token", "hub-contrib.sqlite", "hub.key",
                                                       "ledger.db"]
    assert _mode(state / "hub.key") == _mode(state / "hub-backbone.token") == 0o600
    # The backbone, run where the hub ran, reads the same file with no flag: elsewhere it
    # names the file it looked for (the token is read before the model).
    assert tmp_path / BACKBONE_TOKEN_FILE == state / "hub-backbone.token"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _run(["-m", "backbone", "generate", "--model", "nowhere", "--hub", "127.0.0.1:1", "--prompt", "hi"],
               cwd=elsewhere)
    assert out.returncode == 2 and f"cannot read the token file {BACKBONE_TOKEN_FILE}" in out.stderr, out.stderr


def test_refusal_lines_for_certificates_name_the_fix() -> None:
    """The hub's classification of a failed gateway connection, without a network."""
    from kvasir_rpc import WsHandshakeError, WsRejected
    from relay.hub._gateway_link import describe, refusal_line

    def verify_error(message: str) -> BaseException:
        cause = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
        cause.verify_message = message
        try:
            raise RuntimeError("TLS handshake failed") from cause
        except RuntimeError as exc:
            return exc

    url = "wss://gw.example:8443"
    untrusted = refusal_line(url, verify_error("self-signed certificate"))
    assert untrusted is not None and "--ca-file" in untrusted and "(self-signed certificate)" in untrusted
    mismatch = refusal_line(url, verify_error("Hostname mismatch, certificate is not valid for 'gw.example'."))
    assert mismatch is not None and "kvasir certs --host gw.example" in mismatch
    assert refusal_line(url, WsRejected(401, [], b"")) is not None
    refused = WsHandshakeError("cannot connect to gw.example:8443: [Errno 111] Connection refused")
    refused.__cause__ = ConnectionRefusedError(111, "Connection refused")
    assert refusal_line(url, refused) is None and describe(refused) == "Connection refused"
    assert refusal_line(url, WsRejected(503, [], b"")) is None
    assert describe(WsRejected(503, [], b"")) == "HTTP 503"
