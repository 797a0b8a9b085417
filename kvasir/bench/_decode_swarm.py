"""The decode benches' swarm (``kvasir bench``'s decode, ``--checks``, ``--assist``, ``--service``):
the DECODE_MODEL checkpoint, a TLS gateway, a hub and two workers behind a latency proxy, the
backbones and the hub pinned apart from the rest where the machine allows it.
"""

from __future__ import annotations

import os
import pathlib
import shutil

# One MoE layer's shapes as Qwen3-30B-A3B's (hidden 2048, 32/4 heads of 128 there, here
# 16/4; expert intermediate 768), with 8 experts of which 2 per token and 2 layers: compute
# per layer is what hides a round trip, and a toy hidden size would leave nothing to hide
# it behind (at hidden 512, 64 sequences computed a whole step in ~50 ms locally, less than
# one 50 ms round trip per MoE layer). 300 MB of float32 experts.
DECODE_MODEL = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768, "num_hidden_layers": 2}

# The decode placement: each of the two workers holds half the experts of every MoE layer.
_HALF = DECODE_MODEL["num_experts"] // 2
DECODE_WORKERS = {"worker1": f"*:0-{_HALF - 1}", "worker2": f"*:{_HALF}-{DECODE_MODEL['num_experts'] - 1}"}


def _core_split() -> tuple[frozenset[int], frozenset[int]] | None:
    """(backbone host, elsewhere): the backbone and its hub get one core, the gateway, the
    latency proxy and the workers the rest, so "remote" experts are computed on other
    cores, as on other machines, and the local run has the backbone's core alone."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None
    return frozenset(cpus[:1]), frozenset(cpus[1:])


def start_decode_swarm(sw, tmp: pathlib.Path, split: tuple[frozenset[int], frozenset[int]] | None,  # type: ignore[no-untyped-def]
                       backbones: tuple[str, ...]) -> tuple[pathlib.Path, pathlib.Path]:
    """The decode benches' swarm in ``sw``: the DECODE_MODEL checkpoint, a TLS gateway, a hub,
    and two workers (``DECODE_WORKERS``: half the experts each) that reach the gateway through
    a latency proxy whose round trip is the number in the returned file (ms). With ``split``,
    the processes named ``backbones`` and the hub get the first cores, the rest the others.
    Returns ``(model, rtt_file)``."""
    from kvasir.tiny import make_tiny_checkpoint

    if split is not None:
        sw.default_cpus = split[1]
        for name in (*backbones, "hub"):
            sw.cpus[name] = split[0]
    model = make_tiny_checkpoint(tmp / "model", arch="qwen3_moe", seed=0, overrides=DECODE_MODEL)
    rtt_file = tmp / "rtt_ms"
    sw.start_gateway()
    sw.start_hub(gateway=True)
    proxy = sw.start_latency_proxy("latency", sw.gateway_port, rtt_file)
    url = f"wss://127.0.0.1:{proxy}"
    for name, experts in DECODE_WORKERS.items():
        sw.start_worker(name, model, experts, via="gateway", gateway_url=url)
    sw.wait_sessions(2, watch=["gateway", "latency", "worker1", "worker2"])
    return model, rtt_file
