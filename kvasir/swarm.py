"""The local-swarm launcher: starts the components as separate processes on 127.0.0.1
(port 0 everywhere), waits for them with deadlines, and stops them cleanly. It imports none
of the component packages; it meets them through their command lines and the protos."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import grpc

from kvasir_rpc import session_pb2, session_pb2_grpc

if TYPE_CHECKING:
    from kvasir_rpc import ledger_pb2

__all__ = ["LocalSwarm", "SwarmError", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for programs that cannot bind
    port 0 and report it back (nginx, --direct-grpc). Racy by nature; tooling only."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SwarmError(RuntimeError):
    """A component did not start, or ended badly; the message names its log file."""


class LocalSwarm:
    """Processes of one local swarm, their logs under ``workdir/logs``. Use as a context
    manager: leaving it stops every process (SIGTERM, then SIGKILL after a deadline)."""

    def __init__(self, workdir: str | os.PathLike[str], *, python: str = sys.executable) -> None:
        self.workdir = pathlib.Path(workdir)
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.hub_ws_port = 0
        self.hub_grpc_port = 0
        self.hub_key = ""
        self.hub_http_port = 0
        self.gateway_port = 0
        self.gateway_tls = True
        # Every gateway started, by process name: its ready info (port, hub_port, children...).
        self.gateways: dict[str, dict[str, object]] = {}
        self.ledger_port = 0
        # The --http port of each component started with it, by process name ("gateway", ...).
        self.http_ports: dict[str, int] = {}
        # Every process of a local swarm shares this machine's cores: one torch thread each.
        # Idle OpenMP threads spin, and four processes spinning on two cores made remote
        # calls ~5x slower (measured: 64 tokens in 5.6 s with default threads, 0.9 s with one).
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.env.setdefault("KVASIR_THREADS", "1")
        # Optional CPU pinning by process name ("backbone" for backbones), so a benchmark can
        # give the backbone its own core, as workers on their own hardware would leave it.
        self.cpus: dict[str, frozenset[int]] = {}
        self.default_cpus: frozenset[int] | None = None

    def _pinned(self, name: str, argv: list[str]) -> list[str]:
        cpus = self.cpus.get(name, self.default_cpus)
        taskset = shutil.which("taskset")
        if not cpus or taskset is None:
            return argv
        return [taskset, "-c", ",".join(str(c) for c in sorted(cpus)), *argv]

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: Sequence[str], *, program: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``python ARGS`` (or ``program ARGS``) with its output in ``logs/NAME.log``."""
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = self.procs[name] = subprocess.Popen(
                self._pinned(name, [program or self.python, *args]), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=self.env, cwd=self.workdir,
            )
        return proc

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
            raise SwarmError(f"{name} exited with code {proc.returncode}; log {self.logs / (name + '.log')}:\n{tail}")

    def pid(self, name: str) -> int:
        """The process id of the running process ``name`` (for its CPU time); SwarmError when
        it was never started or has ended."""
        proc = self.procs.get(name)
        if proc is None:
            raise SwarmError(f"no process named {name!r} in this swarm (started: {sorted(self.procs)})")
        self._check_alive(name)
        return proc.pid

    @property
    def hub_ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.hub_ws_port}"

    @property
    def status_url(self) -> str:
        """The hub's status page (the hub started with ``http=True``)."""
        if not self.hub_http_port:
            raise SwarmError("the hub serves no status page: start it with start_hub(http=True)")
        return f"http://127.0.0.1:{self.hub_http_port}/"

    @property
    def hub_grpc_address(self) -> str:
        return f"127.0.0.1:{self.hub_grpc_port}"

    def _wait_ready(self, name: str, ready: pathlib.Path, timeout: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            self._check_alive(name)
            if time.monotonic() > deadline:
                raise SwarmError(f"{name} not listening after {timeout}s; see {self.logs / (name + '.log')}")
            time.sleep(0.05)
        info: dict[str, object] = json.loads(ready.read_text())
        return info

    @property
    def ca_file(self) -> pathlib.Path:
        return self.workdir / "certs" / "ca.pem"

    @property
    def token_file(self) -> pathlib.Path:
        return self.workdir / "hub.token"

    @property
    def gateway_url(self) -> str:
        return f"{'wss' if self.gateway_tls else 'ws'}://127.0.0.1:{self.gateway_port}"

    def start_gateway(self, *, port: int = 0, tls: bool = True, http: bool = False, extra: Sequence[str] = (),
                      timeout: float = 30.0, name: str = "gateway", processes: int = 1) -> dict[str, object]:
        """Start a public gateway (dev certificates and a hub token made on first use); with
        ``http`` its metrics on a free port (``http_ports[name]``; each process's in the
        returned ready info's ``children`` with ``processes`` > 1, which also gives every
        process its own hub-facing port). Several gateways (several "hosts") take distinct
        names; ``gateway_port`` is the one named "gateway". Returns its ready info."""
        from kvasir.certs import make_dev_certs

        if not self.ca_file.exists():
            make_dev_certs(self.workdir / "certs")
        if not self.token_file.exists():
            import secrets

            from kvasir_rpc import write_secret

            write_secret(self.token_file, secrets.token_urlsafe(32) + "\n")
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        certs = self.workdir / "certs"
        tls_args = ["--cert", str(certs / "gateway.pem"), "--key", str(certs / "gateway.key")] if tls else ["--insecure-plain-ws"]
        procs = ["--processes", str(processes), "--hub-listen", "127.0.0.1:0"] if processes > 1 else []
        self._spawn(name, ["-m", "relay", "gateway", "--listen", f"127.0.0.1:{port}", *tls_args,
                           "--hub-token-file", str(self.token_file), "--ready-file", str(ready),
                           *(["--http", "127.0.0.1:0"] if http else []), *procs, *extra])
        self.gateway_tls = tls
        info = self._wait_ready(name, ready, timeout)
        info["tls"] = tls
        self.gateways[name] = info
        if name == "gateway":
            self.gateway_port = int(info["port"])  # type: ignore[call-overload]
        self._keep_http_port(name, info)
        return info

    def gateway_info(self, name: str = "gateway") -> dict[str, object]:
        """The gateway's ready info as it is now (re-read: a restarted process changes it)."""
        info: dict[str, object] = json.loads((self.workdir / f"{name}.ready.json").read_text())
        info["tls"] = self.gateways[name]["tls"]
        return info

    def gateway_hub_urls(self, name: str | None = None) -> list[str]:
        """The URLs a hub takes as --gateway for gateway ``name`` (every gateway started by
        default): one per process, at its hub-facing port, for one with several processes."""
        out: list[str] = []
        for gw, info in self.gateways.items():
            if name is not None and gw != name:
                continue
            scheme = "wss" if info["tls"] else "ws"
            children = info.get("children")
            ports = [c["hub_port"] for c in children] if children else [info["port"]]  # type: ignore[attr-defined, index]
            out += [f"{scheme}://127.0.0.1:{p}" for p in ports]
        return out

    def wait_gateway_restarted(self, name: str, index: int, old_pid: int, timeout: float = 30.0) -> dict[str, object]:
        """Wait until process ``index`` of gateway ``name`` (run with --processes) was
        replaced by a new one that listens; the new ready info."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive(name)
            try:
                info = self.gateway_info(name)
                child = info["children"][index]  # type: ignore[index]
                if child["pid"] != old_pid and child["restarts"]:
                    return info
            except (OSError, ValueError, KeyError):
                pass  # being rewritten
            if time.monotonic() > deadline:
                raise SwarmError(f"{name} process {index} not restarted after {timeout}s; see {self.logs / (name + '.log')}")
            time.sleep(0.1)

    def start_tcp_balancer(self, upstream_ports: Sequence[int], *, name: str = "balancer",
                           timeout: float = 30.0) -> int:
        """HAProxy (Debian's package) in TCP mode in front of ``upstream_ports`` on 127.0.0.1,
        as a load balancer in front of several gateway hosts: TLS passes through to the
        gateways. Round robin; a connection refused by a dead upstream is redispatched to
        another. Returns its port; SwarmError without HAProxy."""
        haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
        if haproxy is None:
            raise SwarmError("haproxy not found: install Debian's haproxy (apt-get install haproxy)")
        port = free_port()
        conf = self.workdir / f"{name}.cfg"
        servers = "\n".join(f"    server gw{i} 127.0.0.1:{p}" for i, p in enumerate(upstream_ports))
        conf.write_text(f"""global
    maxconn 4096
defaults
    mode tcp
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    retries 3
    option redispatch 1
frontend workers
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
{servers}
""")
        self._spawn(name, ["-db", "-f", str(conf)], program=haproxy)
        return self._wait_listening(name, port, timeout, "haproxy")

    def start_service_balancer(self, replicas: Sequence[Mapping[str, object]], *, name: str = "balancer",
                               timeout: float = 30.0) -> tuple[int, int]:
        """HAProxy (Debian's package) in HTTP mode in front of backbone service ``replicas``
        (their ready infos: ``grpc_port``, ``http_port``), as a deployment puts a standard load
        balancer in front of them: the OpenAI API (HTTP/1.1) and gRPC (HTTP/2 cleartext) each
        balanced round robin per request, a replica that stops answering taken out by its
        health check. Returns ``(http_port, grpc_port)``; SwarmError without HAProxy."""
        haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.path.exists("/usr/sbin/haproxy") else None)
        if haproxy is None:
            raise SwarmError("haproxy not found: install Debian's haproxy (apt-get install haproxy)")
        http_port, grpc_port = free_port(), free_port()
        conf = self.workdir / f"{name}.cfg"
        http = "\n".join(f"    server r{i} 127.0.0.1:{r['http_port']} check inter 1s" for i, r in enumerate(replicas))
        grpc_servers = "\n".join(f"    server r{i} 127.0.0.1:{r['grpc_port']} proto h2 check inter 1s"
                                 for i, r in enumerate(replicas))
        conf.write_text(f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    retries 3
    option redispatch 1
frontend openai_api
    bind 127.0.0.1:{http_port}
    default_backend replicas_http
frontend backbone_grpc
    bind 127.0.0.1:{grpc_port} proto h2
    default_backend replicas_grpc
backend replicas_http
    balance roundrobin
{http}
backend replicas_grpc
    balance roundrobin
{grpc_servers}
""")
        self._spawn(name, ["-db", "-f", str(conf)], program=haproxy)
        self._wait_listening(name, http_port, timeout, "haproxy")
        return http_port, self._wait_listening(name, grpc_port, timeout, "haproxy")

    @property
    def hub_key_file(self) -> pathlib.Path:
        return self.workdir / "hub.key"

    @property
    def backbone_token_file(self) -> pathlib.Path:
        """The secret the hub and the backbone share (the hub creates it on first start)."""
        return self.workdir / "backbone.token"

    @property
    def backbone_token(self) -> str:
        """The backbone token, for a test or a benchmark that calls a target or watches itself."""
        from kvasir_rpc import load_or_create_token

        return load_or_create_token(self.backbone_token_file)

    @property
    def ledger_address(self) -> str:
        return f"127.0.0.1:{self.ledger_port}"

    @property
    def ledger_http_url(self) -> str:
        """The base URL of the ledger's HTTP server (metrics, ``GET /v1/balance/WALLET``);
        the ledger must have been started with ``http=True``."""
        if "ledger" not in self.http_ports:
            raise RuntimeError("the ledger serves no HTTP: start_ledger(http=True)")
        return f"http://127.0.0.1:{self.http_ports['ledger']}"

    def _keep_http_port(self, name: str, info: dict[str, object]) -> None:
        if info.get("http_port") is not None:
            self.http_ports[name] = int(info["http_port"])  # type: ignore[call-overload]

    def start_ledger(self, *, db: str | None = None, port: int = 0, http: bool = False,
                     timeout: float = 30.0) -> None:
        """Start the ledger, trusting this swarm's hub key (made now if missing); with ``http``
        its HTTP server (metrics, wallets' balances) on a free port (``http_ports["ledger"]``,
        ``ledger_http_url``)."""
        from kvasir_rpc import Wallet

        hub_key = Wallet.load_or_create(self.hub_key_file).address
        ready = self.workdir / "ledger.ready.json"
        ready.unlink(missing_ok=True)
        url = db or f"sqlite:///{self.workdir / 'ledger.sqlite'}"
        self._spawn("ledger", ["-m", "ledger", "serve", "--listen", f"127.0.0.1:{port}", "--db", url,
                               "--trust-key", hub_key, "--ready-file", str(ready),
                               *(["--http", "127.0.0.1:0"] if http else [])])
        info = self._wait_ready("ledger", ready, timeout)
        self.ledger_port = int(info["port"])  # type: ignore[call-overload]
        self._keep_http_port("ledger", info)

    def start_hub(self, *, gateway: bool = False, listen_port: int = 0, receipt_interval: float = 1.0,
                  http: bool = False, extra: Sequence[str] = (), timeout: float = 30.0,
                  gateway_urls: Sequence[str] | None = None) -> None:
        """Start the hub; with ``gateway`` it also keeps a control connection to each of our
        gateways (to each process of one run with several; ``gateway_urls`` instead when
        given), and when a ledger runs it delivers receipts there. With ``http`` it serves its
        status page and metrics on 127.0.0.1 (``status_url``)."""
        ready = self.workdir / "hub.ready.json"
        ready.unlink(missing_ok=True)
        from kvasir_rpc import load_or_create_token

        load_or_create_token(self.backbone_token_file)  # made once, before the hub or a backbone reads it
        args = ["-m", "relay", "hub", "--listen", f"127.0.0.1:{listen_port}", "--grpc", "127.0.0.1:0",
                "--key", str(self.hub_key_file), "--backbone-token-file", str(self.backbone_token_file),
                "--ready-file", str(ready), "--contrib-db", str(self.workdir / "hub-contrib.sqlite"),
                "--receipt-interval", str(receipt_interval)]
        if self.ledger_port:
            args += ["--ledger", self.ledger_address]
        if http:
            args += ["--http", "127.0.0.1:0"]
        args += list(extra)
        if gateway:
            for url in (gateway_urls if gateway_urls is not None else self.gateway_hub_urls()):
                args += ["--gateway", url]
            args += ["--gateway-token-file", str(self.token_file), "--ca-file", str(self.ca_file)]
        self._spawn("hub", args)
        info = self._wait_ready("hub", ready, timeout)
        self.hub_ws_port, self.hub_grpc_port = int(info["ws_port"]), int(info["grpc_port"])  # type: ignore[call-overload]
        self.hub_key = str(info["hub_key"])
        self.hub_http_port = int(info.get("http_port") or 0)  # type: ignore[call-overload]
        self._keep_http_port("hub", info)

    def start_worker(self, name: str, model: str | os.PathLike[str], experts: str, *, via: str = "hub",
                     gateway_url: str | None = None, hub_url: str | None = None, extra: Sequence[str] = (),
                     launcher: Sequence[str] = ("-m", "worker")) -> subprocess.Popen[bytes]:
        """Start a worker that dials the hub directly (``via="hub"``) or the gateway (at
        ``gateway_url`` when given, e.g. through a latency proxy; the hub at ``hub_url`` when
        given). ``launcher`` is what
        python runs, followed by the worker's arguments (tests run dishonest workers so).

        Once the hub has started, the worker pins its key (``--hub-key``, unless ``extra``
        names one), as an operator should: through a gateway its tunnel is then sealed end to
        end to that hub and no one else."""
        where = (["--hub", hub_url or self.hub_ws_url] if via == "hub"
                 else ["--gateway", gateway_url or self.gateway_url, "--ca-file", str(self.ca_file)])
        if self.hub_key and "--hub-key" not in extra:
            where += ["--hub-key", self.hub_key]
        return self._spawn(name, [*launcher, *where, "--model", str(model),
                                  "--experts", experts, "--wallet", str(self.workdir / f"{name}.wallet"), *extra])

    def list_sessions(self, timeout: float = 5.0) -> list[session_pb2.Session]:
        with grpc.insecure_channel(self.hub_grpc_address) as ch:
            stub = session_pb2_grpc.SessionServiceStub(ch)
            return list(stub.ListSessions(session_pb2.ListSessionsRequest(), timeout=timeout).sessions)

    def wait_sessions(self, n: int, *, timeout: float = 120.0, watch: Sequence[str] = ()) -> list[session_pb2.Session]:
        """Wait until the hub lists at least ``n`` sessions; fail early if a watched process dies."""
        deadline = time.monotonic() + timeout
        while True:
            for name in ("hub", *watch):
                self._check_alive(name)
            sessions = self.list_sessions()
            if len(sessions) >= n:
                return sessions
            if time.monotonic() > deadline:
                raise SwarmError(f"{len(sessions)} of {n} sessions after {timeout}s; logs in {self.logs}")
            time.sleep(0.1)

    def ledger_credits(self, wallet: str, timeout: float = 5.0) -> list[ledger_pb2.Credit]:
        """Every Credit the ledger holds for ``wallet`` (all pages)."""
        from kvasir_rpc import ledger_pb2, ledger_pb2_grpc

        out: list[ledger_pb2.Credit] = []
        with grpc.insecure_channel(self.ledger_address) as ch:
            stub = ledger_pb2_grpc.LedgerServiceStub(ch)
            token = ""
            while True:
                resp = stub.ListCredits(ledger_pb2.ListCreditsRequest(wallet=wallet, page_size=500, page_token=token),
                                        timeout=timeout)
                out.extend(resp.credits)
                token = resp.next_page_token
                if not token:
                    return out

    def ledger_balance(self, wallet: str, timeout: float = 5.0):  # type: ignore[no-untyped-def]
        from kvasir_rpc import ledger_pb2, ledger_pb2_grpc

        with grpc.insecure_channel(self.ledger_address) as ch:
            return ledger_pb2_grpc.LedgerServiceStub(ch).GetBalance(ledger_pb2.GetBalanceRequest(wallet=wallet),
                                                                     timeout=timeout)

    def wait_credited(self, sessions: Sequence[session_pb2.Session], *, timeout: float = 60.0) -> dict[str, int]:
        """Wait until the ledger credited every byte of work the hub counted for the live
        ``sessions``; returns credited bytes per session id."""
        deadline = time.monotonic() + timeout
        while True:
            live = {s.session_id: s for s in self.list_sessions()}
            credited: dict[str, int] = {}
            for s in sessions:
                credited[s.session_id] = sum(int(c.bytes) for c in self.ledger_credits(s.wallet)
                                             if c.session_id == s.session_id)
            counted = {sid: int(s.work_bytes) for sid, s in live.items()}
            if all(credited[s.session_id] == counted.get(s.session_id, -1) for s in sessions):
                return credited
            if time.monotonic() > deadline:
                raise SwarmError(f"ledger credited {credited} of {counted} bytes after {timeout}s; logs in {self.logs}")
            time.sleep(0.2)

    def start_edge(self, upstream_port: int, *, timeout: float = 30.0) -> int:
        """nginx (Debian's package) terminating TLS in front of a plain-ws gateway on
        ``upstream_port``, as a CDN edge would. Returns its port; SwarmError without nginx."""
        import shutil

        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
        if nginx is None:
            raise SwarmError("nginx not found: install Debian's nginx (apt-get install nginx-light)")
        port = free_port()
        root = self.workdir / "edge"
        root.mkdir(exist_ok=True)
        certs = self.workdir / "certs"
        conf = root / "nginx.conf"
        conf.write_text(f"""daemon off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {self.logs}/edge-error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body; proxy_temp_path {root}/proxy; fastcgi_temp_path {root}/fcgi;
    uwsgi_temp_path {root}/uwsgi; scgi_temp_path {root}/scgi;
    map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {certs}/gateway.pem;
        ssl_certificate_key {certs}/gateway.key;
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
        }}
    }}
}}
""")
        self._spawn("edge", ["-p", str(root), "-c", str(conf), "-e", str(self.logs / "edge-error.log")], program=nginx)
        return self._wait_listening("edge", port, timeout, "nginx")

    def _wait_listening(self, name: str, port: int, timeout: float, what: str) -> int:
        """``port`` once process ``name`` (``what``) accepts connections on it; SwarmError if
        it exits first or does not within ``timeout`` seconds."""
        import socket

        deadline = time.monotonic() + timeout
        while True:
            self._check_alive(name)
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return port
            if time.monotonic() > deadline:
                raise SwarmError(f"{what} not listening after {timeout}s; see {self.logs / (name + '.log')}")
            time.sleep(0.05)

    def start_latency_proxy(self, name: str, upstream_port: int, rtt_file: pathlib.Path,
                            timeout: float = 30.0) -> int:
        """A latency proxy to 127.0.0.1:upstream_port whose RTT (ms) is read from ``rtt_file``."""
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        if not rtt_file.exists():
            rtt_file.write_text("0")
        self._spawn(name, ["-m", "kvasir.latency", "--upstream", f"127.0.0.1:{upstream_port}",
                           "--rtt-file", str(rtt_file), "--ready-file", str(ready)])
        return int(self._wait_ready(name, ready, timeout)["port"])  # type: ignore[call-overload]

    def start_trio_relay(self, name: str, upstream_port: int, timeout: float = 30.0) -> int:
        """The bare trio relay to 127.0.0.1:upstream_port (``kvasir.bench.trio_relay``): its port."""
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        self._spawn(name, ["-m", "kvasir.bench.trio_relay", "--upstream", f"127.0.0.1:{upstream_port}",
                           "--ready-file", str(ready)])
        return int(self._wait_ready(name, ready, timeout)["port"])  # type: ignore[call-overload]

    def start_backbone(self, args: Sequence[str], *, hub: bool = True) -> subprocess.Popen[bytes]:
        """Start ``python -m backbone generate --hub <ours> ARGS --json`` (without ``--hub``:
        every expert local); see backbone_result."""
        where = ["--hub", self.hub_grpc_address, "--hub-token-file", str(self.backbone_token_file)] if hub else []
        return subprocess.Popen(
            self._pinned("backbone", [self.python, "-m", "backbone", "generate", *where, *args, "--json"]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env, cwd=self.workdir, stdin=subprocess.DEVNULL,
        )

    def start_backbone_service(self, name: str, model: str | os.PathLike[str], args: Sequence[str] = (), *,
                               hub: bool = True, http: bool = False, timeout: float = 120.0) -> dict[str, object]:
        """Start ``python -m backbone serve`` (named ``name``, gRPC and with ``http`` the HTTP
        API on free ports; with ``hub`` its experts on our hub's workers); its ready info
        ``{grpc_port, http_port, model}`` (the HTTP port also in ``http_ports[name]``: its
        ``/metrics`` too). It runs until stopped (stop_process or stop)."""
        where = ["--hub", self.hub_grpc_address, "--hub-token-file", str(self.backbone_token_file)] if hub else []
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        self._spawn(name, ["-m", "backbone", "serve", "--model", str(model), *where, "--listen", "127.0.0.1:0",
                           *(["--http", "127.0.0.1:0"] if http else []), "--ready-file", str(ready), *args])
        info = self._wait_ready(name, ready, timeout)
        self._keep_http_port(name, info)
        return info

    def backbone_result(self, proc: subprocess.Popen[bytes], *, timeout: float = 600.0) -> dict[str, object]:
        """Wait for a started backbone (killing it past ``timeout``); its JSON result, with
        ``backbone_exit_code`` (0: identical or no comparison asked, 1: a mismatch)."""
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        (self.logs / "backbone.log").write_bytes(err)
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines or proc.returncode not in (0, 1):
            raise SwarmError(f"backbone exited with code {proc.returncode}:\n{err.decode(errors='replace')[-3000:]}")
        result: dict[str, object] = json.loads(lines[-1])
        result["backbone_exit_code"] = proc.returncode
        return result

    def run_backbone(self, args: Sequence[str], *, hub: bool = True, timeout: float = 600.0) -> dict[str, object]:
        """Run ``python -m backbone generate ... --json`` to completion; its JSON result."""
        return self.backbone_result(self.start_backbone(args, hub=hub), timeout=timeout)

    def scrape(self, name: str, timeout: float = 10.0) -> str:
        """The text of ``/metrics`` of process ``name`` (started with its HTTP port)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_ports[name]}/metrics", timeout=timeout) as resp:
            return str(resp.read().decode())

    def stop_process(self, name: str, *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc is not None else None
        proc.send_signal(sig)
        return self._reap(proc, timeout)

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes], timeout: float) -> int:
        """Wait for a signalled process; SIGKILL it past ``timeout``."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout=5)

    def stop(self, timeout: float = 15.0) -> None:
        # Workers first (they drain), then the hub, then the gateway. Processes of one rank
        # (all the workers) are signalled together and drain at once: a swarm of dozens of
        # workers stops in one worker's drain time, not in the sum of them.
        order = {"hub": 1, "edge": 2, "balancer": 2, "gateway": 3, "ledger": 4}

        def rank_of(name: str) -> int:
            return order.get(name, 3 if name in self.gateways else 0)

        for rank in sorted({rank_of(n) for n in self.procs}):
            names = [n for n in self.procs if rank_of(n) == rank and self.procs[n].poll() is None]
            for name in names:
                self.procs[name].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for name in names:
                self._reap(self.procs[name], max(0.1, deadline - time.monotonic()))
        self._kill_strays()

    def _kill_strays(self) -> None:
        """SIGKILL any child of this process still running in the swarm's folder: one whose
        Popen a Ctrl-C interrupted after the fork, before ``procs`` could hold it."""
        import psutil

        known = {proc.pid for proc in self.procs.values()}
        home = os.path.realpath(self.workdir)
        for child in psutil.Process().children():
            try:
                if child.pid not in known and child.cwd() == home:
                    child.kill()
                    child.wait(5)
            except (psutil.Error, OSError):
                pass  # gone already, or not ours to read
