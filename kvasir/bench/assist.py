"""Assisted decoding against plain greedy (``kvasir bench --assist``; ``assist`` in the full bench):
one stream's tokens/s with every MoE layer through the gateway, at RTT 13 and 50 ms.
"""

from __future__ import annotations

import pathlib
import tempfile
import time
from collections.abc import Callable

from kvasir.bench._decode_swarm import DECODE_MODEL, _core_split, start_decode_swarm

ASSIST_RTTS_MS = (13, 50)
ASSIST_PASSAGE = ("The swarm runs the dense layers here and sends each token's expert work to workers far away; "
                  "a round trip per layer is the price of every token.")


def run_assist_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Single-stream (batch 1) decode tokens/s with every MoE layer on two workers through the
    TLS gateway behind the latency proxy, at RTT 13 and 50 ms: plain greedy decoding against
    ``--assist lookup`` (drafts from the prompt's n-grams, verified in one forward pass per
    step), on a prompt that quotes a passage and asks for it again; and with the model as its
    own draft model (``--assist draft``), where every guess holds: the bound of what one
    verifying pass per step gives. Reports the drafts' acceptance and whether the assisted
    texts equal the plain one. The model's weights are random: it does not quote the passage
    as a trained model would, so lookup's acceptance here is what its own repetitions give."""
    from kvasir.swarm import LocalSwarm

    tokens = 24 if quick else 48
    prompt = f"Passage: {ASSIST_PASSAGE}\nRepeat the passage word for word: {ASSIST_PASSAGE}"
    args_common = ["--prompt", prompt, "--max-new-tokens", str(tokens), "--wait-sessions", "2"]
    split = _core_split()
    out: dict[str, object] = {"model": DECODE_MODEL, "new_tokens": tokens, "assist_tokens": 4, "assist_ngram": 3}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-assist-") as tmp, LocalSwarm(tmp) as sw:
        model, rtt_file = start_decode_swarm(sw, pathlib.Path(tmp), split, ("backbone",))
        for rtt in ASSIST_RTTS_MS:
            rtt_file.write_text(str(rtt))
            time.sleep(0.3)  # the proxy re-reads the file every 0.1 s
            plain = sw.run_backbone(["--model", str(model), *args_common])
            assisted = sw.run_backbone(["--model", str(model), *args_common, "--assist", "lookup"])
            # The model itself as its own draft (every expert local, so it costs a local decode
            # of the guesses): every guess holds, the bound of what verifying in one pass gives.
            ideal = sw.run_backbone(["--model", str(model), *args_common, "--assist", "draft", "--draft-model",
                                     str(model)])
            p, a = float(plain["decode_tokens_per_s"]), float(assisted["decode_tokens_per_s"])  # type: ignore[arg-type]
            d = float(ideal["decode_tokens_per_s"])  # type: ignore[arg-type]
            # Here the draft is as costly as the model; a real one is 10-100x smaller. Its
            # time taken out, what is left is the verifying passes' rate with free guesses.
            verify_s = (int(ideal["n_tokens"]) - 1) / d - float(ideal["draft_seconds"])  # type: ignore[call-overload, arg-type]
            free = round((int(ideal["n_tokens"]) - 1) / verify_s, 3) if verify_s > 0 else None  # type: ignore[call-overload]
            out[f"rtt{rtt}"] = {
                "plain_tokens_per_s": p, "assist_tokens_per_s": a, "assist_over_plain": round(a / p, 3),
                "ideal_draft_tokens_per_s": d, "ideal_draft_over_plain": round(d / p, 3),
                "ideal_draft_tokens_per_step": ideal["tokens_per_step"],
                "free_draft_tokens_per_s": free, "free_draft_over_plain": round(free / p, 3) if free else None,
                "ideal_draft_texts_identical": plain["texts"] == ideal["texts"],
                "texts_identical": plain["texts"] == assisted["texts"],
                "acceptance_rate": assisted["acceptance_rate"], "tokens_per_step": assisted["tokens_per_step"],
                "forward_passes_per_token": assisted["forward_passes_per_token"],
                "plain_remote_calls_per_token": round(int(plain["remote_calls"]) / int(plain["n_tokens"]), 3),  # type: ignore[call-overload]
                "assist_remote_calls_per_token": assisted["remote_calls_per_token"],
                "ideal_draft_remote_calls_per_token": ideal["remote_calls_per_token"],
            }
            say(f"  rtt {rtt} ms, one stream: {p} tokens/s plain, {a} with --assist lookup ({round(a / p, 3)}x); "
                f"{assisted['draft_tokens_accepted']} of {assisted['draft_tokens_proposed']} drafts accepted, "
                f"{assisted['tokens_per_step']} tokens per step; same text: {plain['texts'] == assisted['texts']}; "
                f"the model as its own draft: {d} tokens/s ({round(d / p, 3)}x, {ideal['tokens_per_step']} per step; "
                f"{free} tokens/s without the drafting time)")
    return out


def assist_keys(assist: dict[str, object]) -> dict[str, object]:
    """The assist bench's flat keys: tokens/s with and without, and their ratio, by RTT."""
    keys: dict[str, object] = {}
    for rtt in ASSIST_RTTS_MS:
        r = assist[f"rtt{rtt}"]
        keys[f"single_stream_tokens_s_rtt{rtt}_plain"] = r["plain_tokens_per_s"]  # type: ignore[index]
        keys[f"single_stream_tokens_s_rtt{rtt}_assist"] = r["assist_tokens_per_s"]  # type: ignore[index]
        keys[f"assist_over_plain_rtt{rtt}"] = r["assist_over_plain"]  # type: ignore[index]
        keys[f"assist_acceptance_rate_rtt{rtt}"] = r["acceptance_rate"]  # type: ignore[index]
        keys[f"single_stream_tokens_s_rtt{rtt}_ideal_draft"] = r["ideal_draft_tokens_per_s"]  # type: ignore[index]
        keys[f"ideal_draft_over_plain_rtt{rtt}"] = r["ideal_draft_over_plain"]  # type: ignore[index]
        keys[f"free_draft_over_plain_rtt{rtt}"] = r["free_draft_over_plain"]  # type: ignore[index]
    return keys
