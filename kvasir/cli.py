"""The ``kvasir`` command: ``kvasir model tiny DIR``, ``kvasir demo``, ``kvasir bench``, ``kvasir status``,
``kvasir balance``, ``kvasir key show FILE``, ``kvasir conformance``."""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import signal
import sys
import tempfile
import time
from collections.abc import Callable

from kvasir_rpc import HUB_KEY_FILE, STATE_DIR, WALLET_FILE

__all__ = ["build_parser", "entry", "main"]

DEMO_PROMPT = "The swarm computes every expert"
#: Where ``kvasir certs`` writes by default: under the git-ignored .kvasir/, so ca.key stays
#: out of the project's files.
DEFAULT_CERTS_DIR = STATE_DIR / "certs"
DEFAULT_CERT_HOSTS = ("localhost", "127.0.0.1", "::1")
#: Where ``kvasir balance`` asks: the ledger's own default --listen.
DEFAULT_LEDGER = "127.0.0.1:8767"
#: What the figures of ``kvasir balance`` are, in one sentence, for someone who has not read the
#: README (the ledger's rate, 7 nano-KVR a byte by default, is its --rate-nano-per-byte).
KVR_EXPLAINED = ("KVR: credits for expert work the backbones accepted, 1 KVR = 10^9 nano-KVR; the ledger credits "
                 "a worker's wallet from its hub's signed byte receipts")


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from kvasir_rpc import fail

    try:
        path = make_model(args.dir, args.arch, seed=args.seed, dtype=args.dtype, shard=args.shard, quant=args.quant,
                          block=args.fp8_block, group_size=args.group_size)
    except ValueError as exc:
        fail(f"kvasir model tiny: --arch {args.arch}: {exc}")
    print(path)
    return 0


def make_model(directory: pathlib.Path, arch: str, *, seed: int = 0, dtype: str = "float32",
               shard: str | None = None, quant: str | None = None, block: int = 128,
               group_size: int = 32) -> pathlib.Path:
    """A tiny checkpoint of ``arch`` in ``directory``: one of this project's own (``ARCHES``,
    float32, one file) or, for any other Mixture-of-Experts family transformers ships (or with
    another dtype or shards), one transformers makes (``kvasir.families``). Raises
    ValueError naming the families when ``arch`` is none of them."""
    from kvasir.tiny import ARCHES, make_tiny_checkpoint

    if arch in ARCHES and dtype == "float32" and shard is None and quant is None:
        return make_tiny_checkpoint(directory, arch=arch, seed=seed)
    from kvasir.families import make_family_checkpoint, moe_model_types

    known = moe_model_types()
    if arch not in known:
        raise ValueError(f"not a Mixture-of-Experts model type of this transformers; one of: {', '.join(known)}")
    return make_family_checkpoint(directory, arch, dtype=dtype, seed=seed, shard=shard or "200KB", quant=quant,
                                  block=block, group_size=group_size)


def _default_model_dir(arch: str, seed: int) -> pathlib.Path:
    return pathlib.Path(".kvasir") / "models" / f"tiny-{arch}-seed{seed}"


def run_demo(arch: str, *, seed: int = 0, max_new_tokens: int = 12, batch: int = 2,
             model: pathlib.Path | None = None, path: str = "gateway", say=print,  # type: ignore[no-untyped-def]
             workdir: pathlib.Path | None = None,
             stay: Callable[[dict[str, object]], None] | None = None) -> dict[str, object]:
    """Make the tiny model if absent, start a hub and two workers (half the experts each),
    with ``path="gateway"`` behind a TLS gateway that both the hub and the workers dial,
    and a backbone service (``python -m backbone serve``) whose experts are on them. Its
    ``batch`` prompts are decoded by concurrent Generate calls (one running batch), then
    each alone, and compared with a backbone service whose experts are all local (the
    same logits, bit for bit: their digests) and with transformers' eager experts (the
    same tokens). Returns the verdict as a dict. The swarm's files and logs go to
    ``workdir`` (kept) or a temporary folder. The hub serves its status page (``status_url``
    in the result). With ``stay``, it is called with the verdict while the swarm still runs
    (the workers and the hub, the backbones stopped); the swarm stops once it returns."""
    from kvasir.swarm import LocalSwarm
    from kvasir_rpc import DEFAULT_RATE_NANO_PER_BYTE, format_kvr, format_units, read_model_info

    model_dir = model or _default_model_dir(arch, seed)
    if not (model_dir / "config.json").exists():
        say(f"making tiny {arch} checkpoint in {model_dir}")
        make_model(model_dir, arch, seed=seed)
    model_dir = model_dir.resolve()
    info = read_model_info(model_dir)
    half = info.num_experts // 2
    specs = [f"*:0-{half - 1}", f"*:{half}-{info.num_experts - 1}"]
    prompts = [DEMO_PROMPT] + [f"{DEMO_PROMPT} ({i})" for i in range(1, batch)]
    with contextlib.ExitStack() as stack:
        work = str(workdir) if workdir is not None else stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvasir-demo-"))
        swarm = stack.enter_context(LocalSwarm(work))
        t0 = time.monotonic()
        swarm.start_ledger(http=True)
        say(f"ledger: {swarm.ledger_address} (SQLite), trusting the hub's key")
        if path == "gateway":
            swarm.start_gateway(http=True)
            say(f"gateway: {swarm.gateway_url} (TLS, dev CA); the hub and the workers both dial out to it")
        swarm.start_hub(gateway=path == "gateway", http=True)
        say(f"hub: SessionService on {swarm.hub_grpc_address}")
        say(f"status page: {swarm.status_url}")
        for i, spec in enumerate(specs):
            swarm.start_worker(f"worker{i + 1}", model_dir, spec, via=path)
        sessions = swarm.wait_sessions(len(specs), watch=[f"worker{i + 1}" for i in range(len(specs))])
        say(f"{len(sessions)} workers joined in {time.monotonic() - t0:.1f}s (experts {', '.join(specs)})")
        say("starting two backbone services (each loads the model): one with its experts on the swarm, one all local")
        remote = _Service(swarm.start_backbone_service("backbone", model_dir, ["--wait-sessions", str(len(specs))],
                                                       http=True))
        local = _Service(swarm.start_backbone_service("backbone-local", model_dir, hub=False))
        say(f"backbone service: kvasir.v1.BackboneService on 127.0.0.1:{remote.port} (experts on the swarm); "
            f"a reference with every expert local on 127.0.0.1:{local.port}")
        metrics = {name: f"http://127.0.0.1:{port}/metrics" for name, port in swarm.http_ports.items()}
        say("Prometheus metrics: " + ", ".join(f"{name} {url}" for name, url in metrics.items()))
        say(f"{batch} concurrent Generate calls, {max_new_tokens} tokens each; then each alone, on both services")
        result = _demo_decodes(remote, local, prompts, max_new_tokens, say)
        say("checking the tokens against transformers' own eager experts (python -m backbone generate --compare-local)")
        reference = swarm.run_backbone(["--model", str(model_dir), "--prompt", DEMO_PROMPT, "--batch", str(batch),
                                        "--groups", str(batch), "--max-new-tokens", str(max_new_tokens),
                                        "--compare-local"], hub=False)
        result["reference_tokens_identical"] = bool(reference["reference_tokens_identical"]) and (
            reference["texts"] == result["texts"])
        stats = remote.describe().stats
        result.update(remote_calls=stats.remote_calls, remote_rows=stats.remote_rows,
                      fallback_calls=stats.fallback_calls, audited_rows=stats.audited_rows,
                      audit_exact_rows=stats.audit_exact_rows, sessions_quarantined=list(stats.sessions_quarantined),
                      replays=stats.replays, sessions_used=list(stats.sessions_used),
                      shared_overlapped=stats.shared_overlapped)
        # The backbone's own counters, as Prometheus reads them, before it stops.
        result["backbone_metrics"] = _unlabelled_samples(swarm.scrape("backbone"), "kvasir_backbone_")
        result["metrics_urls"] = metrics
        remote.close()
        local.close()
        swarm.stop_process("backbone")  # its last work report reaches the hub as it stops
        after = swarm.list_sessions()
        say("waiting for the hub's signed receipts to be credited")
        credited = swarm.wait_credited(after)
        rows = []
        for s in after:
            nano = sum(int(c.nano_kvr) for c in swarm.ledger_credits(s.wallet) if c.session_id == s.session_id)
            total = int(s.work_bytes)  # paid: the work the backbone accepted, not raw tunnel bytes
            rows.append({"session_id": s.session_id, "wallet": s.wallet, "bytes_in": s.bytes_to_worker,
                         "bytes_out": s.bytes_from_worker, "device": s.device, "bytes": total,
                         "units": format_units(total), "credited_bytes": credited[s.session_id],
                         "credited_nano_kvr": nano, "credited_kvr": format_kvr(nano)})
        ledger_total = sum(int(swarm.ledger_balance(w).pending_nano_kvr) for w in {s.wallet for s in after})
        result["arch"] = arch
        result["path"] = path
        result["sessions"] = rows
        result["ledger_total_nano_kvr"] = ledger_total
        result["rate_nano_per_byte"] = DEFAULT_RATE_NANO_PER_BYTE
        result["status_url"] = swarm.status_url
        if stay is not None:
            # The swarm stays for people to try: a backbone service on it again (the verdict's
            # stopped to report its work), with the OpenAI API, and what attaching more takes.
            say("starting a backbone service on the swarm for you to try (its OpenAI API too)")
            serving = swarm.start_backbone_service("backbone-stay", model_dir, ["--wait-sessions", str(len(specs))],
                                                   http=True)
            result["stay"] = {
                "grpc": f"127.0.0.1:{serving['grpc_port']}", "openai": f"http://127.0.0.1:{serving['http_port']}/v1",
                "model": serving["model"], "model_dir": str(model_dir), "hub": swarm.hub_grpc_address,
                "token_file": str(swarm.backbone_token_file), "hub_key": swarm.hub_key,
                "worker_dial": (f"--gateway {swarm.gateway_url} --ca-file {swarm.ca_file}" if path == "gateway"
                                else f"--hub {swarm.hub_ws_url}")}
            stay(result)
    return result


def _unlabelled_samples(text: str, prefix: str) -> dict[str, float]:
    """The samples of a /metrics text named ``prefix...`` that carry no label, by name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith(prefix) and not sample.labels}


class _Service:
    """A gRPC client of one backbone service."""

    def __init__(self, ready: dict[str, object]) -> None:
        import grpc

        from kvasir_rpc import backbone_pb2_grpc

        self.port = int(ready["grpc_port"])  # type: ignore[call-overload]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = backbone_pb2_grpc.BackboneServiceStub(self.channel)

    def generate(self, prompt: str, max_tokens: int) -> tuple[list[int], str, object]:
        """A greedy Generate of ``max_tokens`` tokens with the logits' digest: (ids, text, summary)."""
        from kvasir_rpc import backbone_pb2

        request = backbone_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True,
                                               digest_logits=True)
        ids: list[int] = []
        text = ""
        summary = None
        for msg in self.stub.Generate(request, timeout=600):
            ids += msg.token_ids
            text += msg.text
            if msg.HasField("summary"):
                summary = msg.summary
        return ids, text, summary

    def describe(self):  # type: ignore[no-untyped-def]
        from kvasir_rpc import backbone_pb2

        return self.stub.Describe(backbone_pb2.BackboneServiceDescribeRequest(), timeout=30)

    def close(self) -> None:
        self.channel.close()


def _demo_decodes(remote: _Service, local: _Service, prompts: list[str], max_tokens: int,
                  say) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """The demo's Generate calls and what they show: together (one batch) the same tokens
    as alone; alone on the swarm the same logits, bit for bit, as alone with local experts."""
    import concurrent.futures

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: remote.generate(p, max_tokens), prompts))
    together_s = time.perf_counter() - t0
    alone = [remote.generate(p, max_tokens) for p in prompts]
    reference = [local.generate(p, max_tokens) for p in prompts]
    n_tokens = sum(len(ids) for ids, _, _ in together)
    summaries = [s for _, _, s in together]
    return {
        "texts": [text for _, text, _ in together],
        "n_tokens": n_tokens,
        "tokens_identical": all(a[0] == b[0] == c[0] for a, b, c in zip(together, alone, reference)),
        "logits_identical": all(a[2].logits_digest == b[2].logits_digest  # type: ignore[attr-defined]
                                for a, b in zip(alone, reference)),
        "tokens_per_s": round(n_tokens / together_s, 2) if together_s > 0 else None,
        "time_to_first_token_s": round(max(s.time_to_first_token_seconds for s in summaries), 4),  # type: ignore[attr-defined]
        "max_batch_size": max(s.max_batch_size for s in summaries),  # type: ignore[attr-defined]
    }


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvasir.bench import run_bench

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.shape is not None:
        from kvasir.bench import run_shape_bench

        say(f"shape {args.shape}: wire bytes per token, worker memory per expert, rows/s through the gateway "
            "against the kernel alone")
        shapes = run_shape_bench(args.shape, quick=args.quick, say=say)  # says each shape's table
        brief = {name: {"ratios": r["ratios"], "figures": r["figures"]}  # type: ignore[index]
                 for name, r in shapes["shapes"].items()}  # type: ignore[attr-defined]
        print(json.dumps(shapes if args.json else brief, indent=None if args.json else 2))
        return 0
    if args.formats:
        from kvasir.bench.formats import run_formats_bench

        say("formats: one expert held in each served format, bytes and dequantizing against computing")
        print(json.dumps(run_formats_bench(quick=args.quick, say=say), indent=None if args.json else 2))
        return 0
    if args.seed_table:
        from kvasir.bench.seed_table import run_seed_table_bench

        say("the seed's table: batching through the gateway, one remote MoE layer at 13 ms RTT, and through an edge")
        seed = run_seed_table_bench(quick=args.quick, say=say)
        say(str(seed["table"]))
        print(json.dumps(seed if args.json else {k: seed[k] for k in ("ratios", "figures", "seconds")},
                         indent=None if args.json else 2))
        return 0
    if args.kv_cache:
        from kvasir.bench.kv_cache import run_kv_cache_bench

        say("kv cache: backbone serve decoding locally against transformers' generate, DynamicCache against the "
            "cache that grows in place")
        kv = run_kv_cache_bench(quick=args.quick, say=say)
        print(json.dumps(kv if args.json else {"ratios": kv["ratios"]}, indent=None if args.json else 2))
        return 0
    if args.service:
        from kvasir.bench.service import run_service_bench

        say("backbone service: 1, 8 and 32 concurrent Generate callers, experts local vs on workers via the gateway")
        service = run_service_bench(quick=args.quick, say=say)
        print(json.dumps(service if args.json else {"ratios": service["ratios"]}, indent=None if args.json else 2))
        return 0
    if args.hops:
        from kvasir.bench import hop_figures, hop_table, run_hop_bench

        say("hops: CPU ns per byte of each process a batch-512 Dispatch call crosses (fabric, gateway, hub paths)")
        hops = run_hop_bench(quick=args.quick, say=say)
        say(hop_table(hops))
        print(json.dumps({"hops": hops} if args.json else {"figures": hop_figures(hops)}, indent=None if args.json else 2))
        return 0
    if args.gateway_processes:
        from kvasir.bench import run_gateway_processes_bench

        say("gateway processes: aggregate MB/s through a TLS gateway, 1 process vs --processes 2")
        procs = run_gateway_processes_bench(quick=args.quick, say=say)
        print(json.dumps(procs, indent=None if args.json else 2))
        return 0
    if args.checks:
        from kvasir.bench import run_checks_bench

        say("checks: the remote decode at RTT 0 with row checks on and off, and audits on and off")
        checks = run_checks_bench(quick=args.quick, say=say)
        print(json.dumps(checks, indent=None if args.json else 2))
        return 0
    if args.decode:
        from kvasir.bench import decode_ratios, run_decode_bench

        say("decode: all experts local vs every MoE layer on workers through the gateway and its fabric-free ceiling, "
            "RTT 0/13/50 ms")
        decode = run_decode_bench(quick=args.quick, say=say)
        print(json.dumps(decode if args.json else decode_ratios(decode), indent=None if args.json else 2))
        return 0
    if args.assist:
        from kvasir.bench import assist_keys, run_assist_bench

        say("one stream: plain greedy vs --assist lookup, every MoE layer through the gateway, RTT 13/50 ms")
        assist = run_assist_bench(quick=args.quick, say=say)
        print(json.dumps(assist if args.json else assist_keys(assist), indent=None if args.json else 2))
        return 0
    result = run_bench(quick=args.quick, say=say)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps({"ratios": result["ratios"], "figures": result["figures"]}, indent=2))
    return 0


def _cmd_certs(args: argparse.Namespace) -> int:
    from kvasir.certs import make_dev_certs

    paths = make_dev_certs(args.dir, args.host or list(DEFAULT_CERT_HOSTS))
    for name, p in paths.items():
        print(f"{name}: {p}")
    return 0


def _unreachable(what: str, address: str, exc: BaseException) -> str:
    """One line for a peer that did not answer, naming the address and the flag."""
    import grpc

    if isinstance(exc, grpc.RpcError):
        code = exc.code()  # type: ignore[attr-defined]
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return f"cannot reach {what} at {address} ({code.name}): is it running, and is this its gRPC address?"
        return f"{what} at {address} answered {code.name}: {exc.details()}"  # type: ignore[attr-defined]
    return f"cannot reach {what} at {address}: {exc}"


def _cmd_status(args: argparse.Namespace) -> int:
    """The hub's live sessions, for a terminal (or one JSON object)."""
    import grpc
    from google.protobuf import json_format

    from kvasir_rpc import format_kvr, session_pb2, session_pb2_grpc
    from kvasir_rpc.protocol import AEAD_NAMES

    try:
        with grpc.insecure_channel(args.hub) as channel:
            sessions = list(session_pb2_grpc.SessionServiceStub(channel).ListSessions(
                session_pb2.ListSessionsRequest(), timeout=args.timeout).sessions)
    except grpc.RpcError as exc:
        print(f"kvasir status: {_unreachable('the hub', args.hub, exc)} (--hub takes the hub's --grpc address)",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"hub": args.hub, "sessions": [json_format.MessageToDict(
            s, preserving_proto_field_name=True) for s in sessions]}))
        return 0
    now_ms = time.time() * 1000
    print(f"hub {args.hub}: {len(sessions)} live session{'s' if len(sessions) != 1 else ''}")
    covered: dict[int, set[int]] = {}
    for s in sorted(sessions, key=lambda x: x.connected_since_unix_ms):
        experts = sum(len(sl.experts) for sl in s.slices)
        for sl in s.slices:
            covered.setdefault(sl.layer, set()).update(sl.experts)
        up = max(0.0, (now_ms - s.connected_since_unix_ms) / 1000)
        print(f"  {s.session_id}  wallet {s.wallet[:16]}…  {s.device or '?'}  {s.model_type}  "
              f"{experts} experts in {len(s.slices)} layers  up {up:.0f} s  "
              f"{'via gateway' if s.via_gateway else 'direct'}  "
              f"{'rows checked' if s.projections else 'sampled audits only'}  "
              f"rtt {f'{s.rtt_ms:.1f} ms' if s.rtt_ms else '?'}  "
              f"work {int(s.work_bytes):,} bytes ({int(s.work_calls):,} calls, {int(s.work_rows):,} rows)  "
              f"credited {format_kvr(int(s.credited_nano_kvr))} KVR  tunnel in {int(s.bytes_to_worker):,} / out "
              f"{int(s.bytes_from_worker):,}  {f'encrypted ({AEAD_NAMES.get(s.aead, s.aead)})' if s.encrypted else 'in clear'}")
    for layer in sorted(covered):
        print(f"  layer {layer}: experts {_ranges(sorted(covered[layer]))} served")
    return 0


def _ranges(xs: list[int]) -> str:
    """Sorted [0, 1, 2, 5] -> "0-2, 5"."""
    runs: list[list[int]] = []
    for x in xs:
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def _cmd_balance(args: argparse.Namespace) -> int:
    """A wallet's credited KVR at a ledger."""
    import grpc

    from kvasir_rpc import Wallet, WalletError, configure_logging, is_address, ledger_pb2, ledger_pb2_grpc

    if args.wallet is None:
        configure_logging("kvasir", level="warning")  # a loose key file's warning goes to stderr
        try:
            wallet = Wallet.load(args.wallet_file).address
        except FileNotFoundError:
            if args.wallet_file == WALLET_FILE:  # the default: nothing was named, so say what it is
                print(f"kvasir balance: no wallet file at {WALLET_FILE} (the default; a worker run in this folder "
                      "creates it): run this where the worker ran, or pass --wallet-file PATH or --wallet HEX",
                      file=sys.stderr)
            else:
                print(f"kvasir balance: {args.wallet_file}: no such wallet file (a worker's is its --wallet)",
                      file=sys.stderr)
            return 2
        except (WalletError, OSError) as exc:
            print(f"kvasir balance: --wallet-file: {exc}", file=sys.stderr)
            return 2
    else:
        wallet = args.wallet.strip().lower()
        if not is_address(wallet):
            print("kvasir balance: --wallet takes a wallet address, 64 hex characters "
                  "(`kvasir key show WALLET_FILE` prints it)", file=sys.stderr)
            return 2
    deadline = time.monotonic() + max(args.wait_credited, 0.0)
    try:
        with grpc.insecure_channel(args.ledger) as channel:
            stub = ledger_pb2_grpc.LedgerServiceStub(channel)
            while True:
                b = stub.GetBalance(ledger_pb2.GetBalanceRequest(wallet=wallet), timeout=args.timeout)
                if b.bytes_credited or time.monotonic() >= deadline:
                    break
                time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
    except grpc.RpcError as exc:
        print(f"kvasir balance: {_unreachable('the ledger', args.ledger, exc)}", file=sys.stderr)
        return 2
    waited_out = args.wait_credited > 0 and not b.bytes_credited
    if args.json:
        print(json.dumps({"wallet": wallet, "pending_kvr": b.pending_kvr, "pending_nano_kvr": int(b.pending_nano_kvr),
                          "bytes_credited": int(b.bytes_credited), "units": b.units,
                          "credit_count": int(b.credit_count)}))
    else:
        print(f"wallet {wallet}: {b.pending_kvr} KVR pending ({int(b.pending_nano_kvr):,} nano-KVR) for "
              f"{int(b.bytes_credited):,} bytes of work ({b.units} units) in {int(b.credit_count)} credits")
        print(KVR_EXPLAINED, file=sys.stderr)  # for the reader; stdout stays the one line of figures
    if waited_out:
        print(f"kvasir balance: nothing credited to this wallet after {args.wait_credited:g} s (--wait-credited): "
              "is the worker's work reaching a hub whose --ledger is this ledger, and does the ledger "
              "--trust-key that hub's key? (the hub's log says why its receipts are refused)", file=sys.stderr)
        return 3
    return 0


def _read_key(path: pathlib.Path) -> tuple[str | None, str]:
    """``(address, "")`` of the key file at ``path`` (its public key in hex), or ``(None, why)``:
    why it cannot be read, in words that name the file."""
    from kvasir_rpc import Wallet, WalletError, configure_logging

    configure_logging("kvasir", level="warning")  # a loose key file's warning goes to stderr, not stdout
    try:
        return Wallet.load(path).address, ""
    except FileNotFoundError:
        return None, (f"{path}: no such key file (a hub's is its --key, {HUB_KEY_FILE} by default; "
                      "`kvasir key new` makes one)")
    except WalletError as exc:  # its message names the file
        return None, str(exc)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"


def _cmd_key_show(args: argparse.Namespace) -> int:
    address, why = _read_key(args.file)
    if address is None:
        print(f"kvasir key show: {why}", file=sys.stderr)
        return 2
    print(address)
    return 0


def _cmd_key_new(args: argparse.Namespace) -> int:
    """Make a key file (a hub's --key, or a worker's --wallet) and print its address: the hub's
    key can be trusted by a ledger (--trust-key) before the hub first runs. An existing file is
    never overwritten (it may be the key a ledger trusts already): its address is printed
    instead, with exit status 2."""
    import nacl.signing

    from kvasir_rpc import Wallet, write_secret

    key = nacl.signing.SigningKey.generate()
    try:
        # The wallet file format (Wallet.load): the 32-byte seed as 64 hex characters. Linked into
        # place, never renamed over: a file that exists, even one made at this moment, stays.
        write_secret(args.file, key.encode().hex() + "\n", replace=False)
    except FileExistsError:
        address, why = _read_key(args.file)
        if address is None:
            print(f"kvasir key new: {args.file} exists already and is never overwritten, and it is no key: {why}",
                  file=sys.stderr)
            return 2
        print(address, flush=True)
        print(f"kvasir key new: {args.file} exists already and is never overwritten; its public key is {address}",
              file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvasir key new: cannot write {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(Wallet(key).address, flush=True)
    use = ("a hub started in this folder uses the file (its --key default)" if args.file == HUB_KEY_FILE
           else f"start the hub with --key {args.file}")
    print(f"kvasir key new: wrote {args.file} (mode 0600); give the public key above to the ledger "
          f"(python -m ledger serve --trust-key HEX); {use}", file=sys.stderr)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvasir.swarm import SwarmError
    from kvasir_rpc import CHECKPOINT_HINT, CheckpointError, check_checkpoint, fail

    if args.max_new_tokens < 1 or args.batch < 1:
        fail("kvasir demo: --max-new-tokens and --batch must be at least 1")
    if args.model is not None:
        # Before anything starts; and a folder that is not a checkpoint is never written into.
        try:
            check_checkpoint(args.model)
        except CheckpointError as exc:
            fail(f"kvasir demo: --model {args.model}: {exc}; {CHECKPOINT_HINT}")
    else:
        from kvasir.tiny import ARCHES

        if args.arch not in ARCHES:
            from kvasir.families import moe_model_types

            known = moe_model_types()
            if args.arch not in known:
                fail(f"kvasir demo: --arch {args.arch}: not a Mixture-of-Experts model type of this transformers; "
                     f"one of: {', '.join(known)}")
    quiet = args.json

    def say(msg: str) -> None:
        print(msg, file=sys.stderr if quiet else sys.stdout, flush=True)

    shown: list[int] = []

    def stay(result: dict[str, object]) -> None:
        shown.append(_show_verdict(args, result))
        t = result["stay"]
        assert isinstance(t, dict)
        say(f"""
the swarm keeps running (Ctrl-C stops it): status page {result['status_url']}
  the OpenAI API:  curl {t['openai']}/completions -H 'Content-Type: application/json' \\
                     -d '{{"model": "{t['model']}", "prompt": "Hello", "max_tokens": 16}}'
  gRPC:            grpcurl -plaintext -d '{{"prompt": "Hello", "max_tokens": 16}}' {t['grpc']} \\
                     kvasir.v1.BackboneService/Generate
  another backbone on these workers:
                   python -m backbone generate --model {t['model_dir']} --hub {t['hub']} \\
                     --hub-token-file {t['token_file']} --prompt "Hello" --compare-local
  another worker (the hub suggests its slice):
                   python -m worker {t['worker_dial']} --hub-key {t['hub_key']} \\
                     --model {t['model_dir']} --experts auto --wallet .kvasir/another-wallet.key""")
        def on_term(signum: int, frame: object) -> None:
            raise KeyboardInterrupt  # SIGTERM stops the swarm as Ctrl-C does, not only this process

        signal.signal(signal.SIGTERM, on_term)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            say("stopping the swarm")

    try:
        result = run_demo(args.arch, seed=args.seed, max_new_tokens=args.max_new_tokens, batch=args.batch,
                          model=args.model, path=args.path, say=say, stay=stay if args.stay else None)
    except SwarmError as exc:
        # Several lines on purpose: the failing component's log tail says what went wrong.
        print(f"kvasir demo: failed: {exc}", file=sys.stderr)
        return 2
    return shown[0] if shown else _show_verdict(args, result)


def _show_verdict(args: argparse.Namespace, result: dict[str, object]) -> int:
    """Print the demo's verdict (one JSON line with --json); 0 when it holds, else 1."""
    paid = result["ledger_total_nano_kvr"] == sum(
        s["bytes"] * result["rate_nano_per_byte"] for s in result["sessions"]  # type: ignore[attr-defined]
    )
    # Two verdicts pass: every logit bitwise the local run's, or the same tokens with logits that
    # differ within what the checks allow (workers on other hardware); --require-bitwise only the
    # first. Tokens that differ, or a byte not credited once, always fail.
    bitwise = bool(result.get("tokens_identical")) and bool(result.get("logits_identical"))
    within = bool(result.get("tokens_identical")) and not bitwise
    result["verdict"] = ("bitwise equal" if bitwise else "within the audit bound, tokens identical" if within
                         else "tokens differ")
    ok = paid and (bitwise or (within and not args.require_bitwise))
    if args.json:
        print(json.dumps(result))
    else:
        for text in result.get("texts", []):  # type: ignore[attr-defined]
            print(f"  > {text!r}")
        print(f"remote calls {result['remote_calls']}, rows {result['remote_rows']}, "
              f"fallbacks {result['fallback_calls']}; audited rows {result['audited_rows']} "
              f"({result['audit_exact_rows']} bit-exact), quarantined {len(result['sessions_quarantined'])}")  # type: ignore[arg-type]
        for s in result["sessions"]:  # type: ignore[attr-defined]
            print(f"  session {s['session_id']} wallet {s['wallet'][:16]}… work {s['bytes']:,} bytes "
                  f"= {s['units']} units -> credited {s['credited_kvr']} KVR "
                  f"(tunnel: in {s['bytes_in']:,}, out {s['bytes_out']:,})")
        print(f"ledger total {result['ledger_total_nano_kvr']:,} nano-KVR "
              f"({result['rate_nano_per_byte']} nano-KVR per byte)")
        print(f"{result['n_tokens']} tokens in one batch of {result['max_batch_size']}: "
              f"{result['tokens_per_s']} tokens/s, first token after {result['time_to_first_token_s']} s")
        print(f"tokens identical together and alone, swarm and local: {result['tokens_identical']}; "
              f"every logit of every step bitwise identical to local (SHA-256 of the logits): "
              f"{result['logits_identical']}")
        print(f"tokens identical to transformers' eager experts: {result['reference_tokens_identical']}")
        if not paid:
            print("VERDICT: MISMATCH: the ledger's credits are not every byte once")
        elif bitwise:
            print("VERDICT: remote decode is bitwise identical to local; every byte credited once")
        elif within:
            print("VERDICT: " + ("" if ok else "MISMATCH (--require-bitwise): ") + "remote decode is within the "
                  "audit bound, tokens identical to local (logits not bitwise); every byte credited once")
        else:
            print("VERDICT: MISMATCH: the remote decode's tokens differ from local")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The ``kvasir`` command line, every sub-command included."""
    from kvasir.bench import SHAPE_ALL, SHAPES
    from kvasir.tiny import ARCHES
    from kvasir_rpc import HelpFormatter

    def add(sub, name: str, **kwargs):  # type: ignore[no-untyped-def]
        return sub.add_parser(name, formatter_class=HelpFormatter, **kwargs)

    parser = argparse.ArgumentParser(prog="kvasir", description="Kvasir RPC: MoE experts on whatever hardware shows up.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    model = add(sub, "model", help="checkpoint tools")
    msub = model.add_subparsers(dest="model_command", required=True)
    tiny = add(msub, "tiny", help="write a small random MoE checkpoint in the Hugging Face layout")
    tiny.add_argument("dir", type=pathlib.Path, help="the folder to write (config.json, model.safetensors, tokenizer)")
    tiny.add_argument("--arch", default="qwen3_moe",
                      help=f"the model type: {', '.join(ARCHES)} (this project's own, one float32 file), or any "
                           "Mixture-of-Experts model type the installed transformers ships (deepseek_v3, glm4_moe, "
                           "...: made by transformers' save_pretrained)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed, same bytes)")
    tiny.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                      help="the weights' dtype (not float32: made by transformers)")
    tiny.add_argument("--shard", metavar="SIZE",
                      help="save in shards of at most SIZE (e.g. 200KB), as releases are (made by transformers)")
    tiny.add_argument("--quant", choices=["fp8", "mxfp4", "ct-fp8", "ct-int4"],
                      help="write it as a release is laid out: fp8, block FP8 (float8_e4m3fn weights with a float32 "
                           "weight_scale_inv per block); mxfp4, gpt-oss's experts (4-bit blocks and scales); ct-fp8 "
                           "and ct-int4, compressed-tensors as llm-compressor writes it (FP8 with a scale per row; "
                           "W4A16: symmetric int4 packed in int32, a scale per group); needs --dtype bfloat16")
    tiny.add_argument("--fp8-block", type=int, default=128, metavar="N",
                      help="the FP8 blocks' side (the releases' 128; smaller to give tiny weights several blocks)")
    tiny.add_argument("--group-size", type=int, default=32, metavar="N",
                      help="ct-int4: inputs per scale (the releases' 128; 32 divides the tiny widths)")
    tiny.set_defaults(func=_cmd_model_tiny)
    bench = add(sub, "bench", help="benchmarks: the paths side by side in one run, as ratios")
    bench.add_argument("--quick", action="store_true", help="fewer calls per point")
    bench.add_argument("--json", action="store_true", help="print the whole result as one JSON object")
    bench.add_argument("--service", action="store_true",
                       help="only the backbone service: 1, 8 and 32 concurrent callers, local vs remote")
    bench.add_argument("--seed-table", action="store_true",
                       help="only the seed's reference figures beside ours: rows/s at batch 512 over batch 1 through "
                            "the gateway, and what one remote MoE layer of many at 13 ms RTT costs a single stream, "
                            "through the gateway and through nginx terminating TLS in front of it (needs nginx; "
                            "a few minutes)")
    bench.add_argument("--kv-cache", action="store_true",
                       help="only the local decode: backbone serve against transformers' own generate, and "
                            "DynamicCache against the KV cache that grows in place (tokens/s, page faults per token)")
    bench.add_argument("--hops", action="store_true",
                       help="only the fabric's cost by hop: CPU ns per byte of the client, hub, gateway and worker "
                            "at batch 512 (under 2 minutes)")
    bench.add_argument("--gateway-processes", action="store_true",
                       help="only the gateway's scaling: aggregate MB/s through a TLS gateway with 1 process and with "
                            "--processes 2, 4 workers and 4 callers")
    bench.add_argument("--assist", action="store_true",
                       help="only one stream's tokens/s at RTT 13 and 50 ms, plain vs --assist lookup")
    bench.add_argument("--decode", action="store_true",
                       help="only the decode: every expert local, every MoE layer on workers through the gateway, "
                            "and the same placement's fabric-free ceiling, at RTT 0, 13 and 50 ms; with what checking "
                            "costs it and the CPU per byte of each process")
    bench.add_argument("--checks", action="store_true",
                       help="only what checking workers costs: the remote decode with row checks on and off, and "
                            "audits on and off (tokens/s, the backbone's CPU per row, wire bytes per row)")
    bench.add_argument("--formats", action="store_true",
                       help="only the checkpoint formats a worker holds (bfloat16, block FP8, MXFP4, compressed-tensors "
                            "FP8 and int4): bytes per expert, and dequantizing against computing (a few seconds)")
    bench.add_argument("--shape", metavar="NAME", choices=[*SHAPES, SHAPE_ALL],
                       help="only a real release's widths, to size a swarm: bytes on the wire per token, a worker's "
                            "memory per expert, rows/s through the gateway against the kernel alone; NAME is one of "
                            f"{', '.join(SHAPES)}, or {SHAPE_ALL} (each in turn)")
    bench.set_defaults(func=_cmd_bench)
    certs = add(sub, "certs", help="make a development CA and a gateway certificate")
    certs.add_argument("dir", type=pathlib.Path, nargs="?", default=DEFAULT_CERTS_DIR,
                       help="the folder for ca.pem, ca.key, gateway.pem and gateway.key (keys mode 0600)")
    certs.add_argument("--host", action="append",
                       help="name or IP the gateway certificate covers (repeatable; default: "
                            f"{', '.join(DEFAULT_CERT_HOSTS)}, this machine only): a real deployment must name "
                            "the host workers dial, e.g. --host gateway.example.org")
    certs.set_defaults(func=_cmd_certs)
    status = add(sub, "status", help="a hub's live sessions and the experts they serve")
    status.add_argument("--hub", required=True, help="HOST:PORT of the hub's SessionService (its --grpc)")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the hub")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(func=_cmd_status)
    balance = add(sub, "balance", help="a wallet's KVR credited at a ledger", description=KVR_EXPLAINED)
    balance.add_argument("--ledger", default=DEFAULT_LEDGER,
                         help="HOST:PORT of the ledger's LedgerService (its --listen)")
    who = balance.add_mutually_exclusive_group()
    who.add_argument("--wallet", help="the wallet's address (64 hex characters)")
    who.add_argument("--wallet-file", type=pathlib.Path, default=WALLET_FILE,
                     help="a wallet key file (a worker's --wallet); read unless --wallet is given")
    balance.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the ledger")
    balance.add_argument("--wait-credited", type=float, default=0.0, metavar="SECONDS",
                         help="wait up to SECONDS for a first credit (the hub sends receipts every few seconds); "
                              "exit status 3 if none came")
    balance.add_argument("--json", action="store_true", help="print one JSON object")
    balance.set_defaults(func=_cmd_balance)
    key = add(sub, "key", help="key files of hubs and wallets")
    ksub = key.add_subparsers(dest="key_command", required=True)
    show = add(ksub, "show", help="print a key file's public address (what a ledger's --trust-key takes)")
    show.add_argument("file", type=pathlib.Path, nargs="?", default=HUB_KEY_FILE,
                      help="the key file (the hub's by default); it stays private, only the address is printed")
    show.set_defaults(func=_cmd_key_show)
    new = add(ksub, "new", help="make a key file (mode 0600) and print its address: a hub's key to trust on a ledger "
                                "before the hub first runs, or a worker's wallet")
    new.add_argument("file", type=pathlib.Path, nargs="?", default=HUB_KEY_FILE,
                     help="the key file to make, never overwritten (the hub's --key by default)")
    new.set_defaults(func=_cmd_key_new)
    demo = add(sub, "demo", help="the whole swarm on this machine: hub, two workers, a live decode, the verdict")
    demo.add_argument("--arch", default="qwen3_moe",
                      help="model type of the tiny checkpoint made when --model is not given (as kvasir model tiny "
                           "--arch)")
    demo.add_argument("--seed", type=int, default=0, help="seed of that tiny checkpoint's weights")
    demo.add_argument("--model", type=pathlib.Path,
                      help="a checkpoint folder (default: a tiny one, made under .kvasir/models/ on first use)")
    demo.add_argument("--max-new-tokens", type=int, default=12, help="tokens decoded per prompt")
    demo.add_argument("--batch", type=int, default=2, help="prompts decoded together, as concurrent Generate calls")
    demo.add_argument("--path", choices=["gateway", "hub"], default="gateway",
                      help="workers reach the hub through the TLS gateway or directly")
    demo.add_argument("--json", action="store_true", help="last line of stdout: one JSON object")
    demo.add_argument("--require-bitwise", action="store_true",
                      help="pass only when every logit is bitwise the local run's (else the same tokens, within the "
                           "audit bound, pass too)")
    demo.add_argument("--stay", action="store_true",
                      help="after the verdict, keep the swarm running (see its status page) until Ctrl-C")
    demo.set_defaults(func=_cmd_demo)
    from kvasir import conformance

    conformance.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one ``kvasir`` command; its exit status. Errors a person can fix end in one line
    on stderr (exit 2); Ctrl-C is left to the caller (see entry)."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def _prog(argv: list[str]) -> str:
    """``kvasir COMMAND`` for the one-line ends (``kvasir demo: interrupted``)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    return f"kvasir {command}" if command else "kvasir"


def entry() -> None:
    """The ``kvasir`` console script: main, with Ctrl-C ending in one line and exit 130."""
    from kvasir_rpc import run_main

    run_main(_prog(sys.argv[1:]), main)


if __name__ == "__main__":
    entry()
