"""What checking the workers costs (``kvasir bench --checks``; ``row_checks`` and ``audit`` in the
decode bench): the same remote decode with row checks off and on, and audits off and on.
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

from kvasir.bench._decode_swarm import DECODE_MODEL, _core_split, start_decode_swarm


def run_checks_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Only what checking the workers costs (``kvasir bench --checks``): on the decode bench's
    swarm, the remote decode at RTT 0 with row checks on and off, and with audits on and off."""
    from kvasir.swarm import LocalSwarm

    batch, tokens = (32, 6) if quick else (128, 16)
    args_common = ["--prompt", "the swarm", "--max-new-tokens", str(tokens), "--batch", str(batch)]
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "batch": batch, "new_tokens": tokens}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-checks-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("backbone",))
        rtt_file.write_text("0")
        first = sw.run_backbone(["--model", str(model), *args_common, "--groups", "auto", "--wait-sessions", "2"])
        groups = int(first["groups"])  # type: ignore[call-overload]
        out["row_checks"] = row_check_cost(sw, model, args_common, groups=groups, rtt_file=rtt_file, say=say)
        out["audit"] = _audit_cost(sw, model, args_common, groups=groups, rtt_file=rtt_file, say=say)
    return out


def row_check_cost(sw, model: pathlib.Path, args_common: list[str], *, groups: int,  # type: ignore[no-untyped-def]
                   rtt_file: pathlib.Path, say: Callable[[str], None]) -> dict[str, object]:
    """What checking every row costs, at RTT 0: the same remote decode with ``--row-checks
    off`` and on (the default), alternated twice (this machine is noisy); medians of tokens/s,
    the backbone's CPU time in the row checks per row checked, and the bytes the answers took
    on the wire per remote row, on against off (the projections travel with the partials)."""
    rtt_file.write_text("0")
    time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
    runs: dict[str, list[dict[str, object]]] = {"off": [], "on": []}
    for _ in range(2):
        for mode in ("off", "on"):
            runs[mode].append(sw.run_backbone(["--model", str(model), *args_common, "--groups", str(groups),
                                               "--wait-sessions", "2", "--row-checks", mode]))
    rate = {m: statistics.median(float(r["decode_tokens_per_s"]) for r in rs) for m, rs in runs.items()}  # type: ignore[arg-type]

    def per_row(mode: str, key: str) -> float:
        total = sum(float(str(r[key])) for r in runs[mode])
        rows = sum(int(r["remote_rows"]) for r in runs[mode])  # type: ignore[call-overload]
        return total / rows if rows else 0.0

    on = runs["on"]
    checked = sum(int(r["row_checked_rows"]) for r in on)  # type: ignore[call-overload]
    seconds = sum(float(str(r["row_check_seconds"])) for r in on)
    cpu = sum(float(str(r["cpu_seconds"])) for r in on)
    result: dict[str, object] = {
        "groups": groups,
        "tokens_per_s_row_checks_off": round(rate["off"], 3), "tokens_per_s_row_checks_on": round(rate["on"], 3),
        "on_over_off": round(rate["on"] / rate["off"], 3) if rate["off"] else None,
        "rows_checked": checked, "row_check_seconds": round(seconds, 4),
        "row_check_us_per_row": round(seconds / checked * 1e6, 3) if checked else None,
        "row_check_share_of_backbone_cpu": round(seconds / cpu, 4) if cpu else None,
        "received_bytes_per_row_on": round(per_row("on", "received_bytes"), 1),
        "received_bytes_per_row_off": round(per_row("off", "received_bytes"), 1),
        "sent_bytes_per_row_on": round(per_row("on", "sent_bytes"), 1),
        "sent_bytes_per_row_off": round(per_row("off", "sent_bytes"), 1),
        "refusals": sum(int(r["row_check_refusals"]) for r in on),  # type: ignore[call-overload]
    }
    off_bytes = result["received_bytes_per_row_off"] + result["sent_bytes_per_row_off"]  # type: ignore[operator]
    on_bytes = result["received_bytes_per_row_on"] + result["sent_bytes_per_row_on"]  # type: ignore[operator]
    result["wire_bytes_on_over_off"] = round(on_bytes / off_bytes, 4) if off_bytes else None
    say(f"  row checks: {result['tokens_per_s_row_checks_on']} tokens/s against {result['tokens_per_s_row_checks_off']} "
        f"off ({result['on_over_off']}); {checked} rows checked at {result['row_check_us_per_row']} us each of the "
        f"backbone's CPU; wire bytes per remote row {on_bytes:.0f} against {off_bytes:.0f} "
        f"({result['wire_bytes_on_over_off']})")
    return result


def _audit_cost(sw, model: pathlib.Path, args_common: list[str], *, groups: int, rtt_file: pathlib.Path,  # type: ignore[no-untyped-def]
                say: Callable[[str], None]) -> dict[str, object]:
    """The audits' price at RTT 0: the same remote decode with audits off and at the default
    rate, alternated twice (this machine is noisy), same groups; medians, and the share of the
    decode's wall time the backbone spent auditing."""
    rtt_file.write_text("0")
    time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
    runs: dict[str, list[dict[str, object]]] = {"off": [], "on": []}
    for _ in range(2):
        for mode in ("off", "on"):
            extra = ["--audit-rate", "0"] if mode == "off" else []
            runs[mode].append(sw.run_backbone(["--model", str(model), *args_common, "--groups", str(groups),
                                               "--wait-sessions", "2", *extra]))
    rate = {m: statistics.median(float(r["decode_tokens_per_s"]) for r in rs) for m, rs in runs.items()}  # type: ignore[arg-type]
    on = runs["on"]
    audited = sum(int(r["audited_rows"]) for r in on)  # type: ignore[call-overload]
    remote_rows = sum(int(r["remote_rows"]) for r in on)  # type: ignore[call-overload]
    seconds = sum(float(str(r["audit_seconds"])) for r in on)
    wall = sum(float(str(r["seconds"])) for r in on)
    result = {
        "audit_rate": on[0]["audit_rate"], "groups": groups,
        "tokens_per_s_audits_off": round(rate["off"], 3), "tokens_per_s_audits_on": round(rate["on"], 3),
        "on_over_off": round(rate["on"] / rate["off"], 3) if rate["off"] else None,
        "audited_rows": audited, "remote_rows": remote_rows, "audit_seconds": round(seconds, 3),
        # Rows equal bit for bit to the backbone's own kernel: these need no error bound.
        "audit_exact_rows": sum(int(r["audit_exact_rows"]) for r in on),  # type: ignore[call-overload]
        "audit_share_of_wall": round(seconds / wall, 4) if wall else None,
        "quarantined": sorted({s for r in on for s in r["sessions_quarantined"]}),  # type: ignore[attr-defined]
    }
    say(f"  audits at {result['audit_rate']}: {result['tokens_per_s_audits_on']} tokens/s against "
        f"{result['tokens_per_s_audits_off']} off ({result['on_over_off']}); {audited} of {remote_rows} rows "
        f"audited in {result['audit_seconds']} s of the backbone's CPU time")
    return result
