"""``kvasir bench --kv-cache``: ``backbone serve`` decoding locally against transformers' own
``generate``, and what the KV cache that grows in place changes, on the decode bench's model.

Three paths, alternated (this machine is noisy), on the same model, prompts and batch:

* ``generate``: transformers' ``generate`` as a user calls it (its ``DynamicCache``, its own
  experts implementation), in this process;
* ``generate_growing``: the same call on the backbone's cache (``kvasir_rpc.growing_cache``,
  room for the run): the cache alone changed;
* ``serve``: a ``backbone serve`` process, experts local (continuous batch, the backbone's
  kernel, the growing cache), every sequence sent at once as its own Generate call.

For each: tokens/s over the whole run (prefill included) and over the decode steps alone,
tokens per CPU second of the process that decodes (``generate``: this one; ``serve``: the
service's, so the bench's 128 calling threads on the same cores do not count against it), the
minor page faults per token over the whole run and per step once the batch is decoding (the
kernel handing the process fresh pages; for ``serve`` the service process's), and the KV bytes
``DynamicCache`` copies per step at the end of the run (the growing cache copies only when it
takes a new buffer: once a run when told the run's length).
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvasir.bench.cpu import cpu_seconds, minor_faults

__all__ = ["run_kv_cache_bench"]

PATHS = ("generate", "generate_growing", "serve")


class _Steps:
    """A stopping criterion that stops nothing: the time and faults at each step's end."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, int]] = []

    def __call__(self, input_ids: Any, scores: Any, **kwargs: object) -> Any:
        import torch

        self.marks.append((time.perf_counter(), minor_faults()))
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)


def _summary(rows: int, started: tuple[float, int], ended: tuple[float, int],
             steps: list[tuple[float, int]], cpu_s: float) -> dict[str, float]:
    """Whole-run and decode-phase figures; ``steps``: (time, faults) at each step's end;
    ``cpu_s``: the decoding process's CPU seconds over the run."""
    tokens = rows * len(steps)
    skip = min(4, len(steps) - 2)  # the first steps settle the allocator; then the batch decodes
    (t0, f0), (t1, f1) = steps[skip], steps[-1]
    n = len(steps) - 1 - skip
    return {"tokens_per_s": tokens / (ended[0] - started[0]),
            "decode_tokens_per_s": rows * n / (t1 - t0),
            "tokens_per_cpu_s": tokens / cpu_s,
            "faults_per_token": (ended[1] - started[1]) / tokens,
            "decode_faults_per_step": (f1 - f0) / n}


def _generate(model: Any, enc: Any, tokens: int, cache: Any) -> dict[str, float]:
    import torch
    from transformers import StoppingCriteriaList

    steps = _Steps()
    kwargs = {"cache": cache} if cache is not None else {}
    cpu = cpu_seconds()
    started = (time.perf_counter(), minor_faults())
    with torch.inference_mode():
        model.generate(**enc, do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList([steps]), **kwargs)
    ended = (time.perf_counter(), minor_faults())
    return _summary(enc["input_ids"].shape[0], started, ended, steps.marks, cpu_seconds() - cpu)


def _serve(stub: Any, pid: int, prompts: list[str], tokens: int) -> dict[str, float]:
    """Every prompt its own Generate call, all at once; the steps are the last call's tokens
    (by then every row is in the batch)."""
    from kvasir_rpc import backbone_pb2

    steps: list[tuple[float, int]] = []

    def call(i: int) -> int:
        n = 0
        request = backbone_pb2.GenerateRequest(prompt=prompts[i], max_tokens=tokens, ignore_eos=True)  # greedy
        for msg in stub.Generate(request, timeout=600):
            if msg.token_ids:
                n += len(msg.token_ids)
                if i == len(prompts) - 1:
                    steps.append((time.perf_counter(), minor_faults(pid)))
        return n

    cpu = cpu_seconds(pid)
    started = (time.perf_counter(), minor_faults(pid))
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = sum(pool.map(call, range(len(prompts))))
    ended = (time.perf_counter(), minor_faults(pid))
    if got != tokens * len(prompts) or len(steps) < 3:
        raise RuntimeError(f"backbone serve answered {got} tokens of {tokens * len(prompts)}")
    return _summary(len(prompts), started, ended, steps, cpu_seconds(pid) - cpu)


def _kv_bytes_per_step(model: Any, rows: int, context: int) -> int:
    """What DynamicCache copies per step at ``context`` tokens: every layer's keys and values."""
    from transformers import DynamicCache

    config = model.config
    heads = int(getattr(config, "num_key_value_heads", 0) or config.num_attention_heads)
    dim = int(getattr(config, "head_dim", 0) or config.hidden_size // config.num_attention_heads)
    layers = len(DynamicCache(config=config).layers)
    return 2 * layers * rows * heads * context * dim * model.dtype.itemsize


def _point(model: Any, tokenizer: Any, stub: Any, pid: int, prompts: list[str], tokens: int, rounds: int,
           say: Callable[[str], None]) -> dict[str, object]:
    """The three paths on ``prompts``, ``rounds`` times each after a warm-up, in a rotated order
    (each path follows each other path): their medians."""
    from kvasir_rpc import growing_cache

    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    run_tokens = enc["input_ids"].shape[1] + tokens
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in PATHS}
    for r in range(rounds + 1):  # the first round warms every path up, unmeasured
        order = PATHS[r % len(PATHS):] + PATHS[:r % len(PATHS)]
        for p in order:
            if p == "serve":
                got = _serve(stub, pid, prompts, tokens)
            else:
                cache = growing_cache(model.config, run_tokens) if p == "generate_growing" else None
                got = _generate(model, enc, tokens, cache)
            if r:
                runs[p].append(got)
                say(f"    {p}: {got['tokens_per_s']:.0f} tokens/s ({got['decode_tokens_per_s']:.0f} decoding, "
                    f"{got['tokens_per_cpu_s']:.0f} per CPU second), "
                    f"{got['faults_per_token']:.1f} faults per token, {got['decode_faults_per_step']:.1f} per "
                    "decode step")
    out: dict[str, object] = {"batch": len(prompts), "prompt_tokens": enc["input_ids"].shape[1], "new_tokens": tokens}
    for p in PATHS:
        out[p] = {k: round(statistics.median(x[k] for x in runs[p]), 2) for k in runs[p][0]}
        out[p]["decode_tokens_per_s_runs"] = [round(x["decode_tokens_per_s"], 1) for x in runs[p]]  # type: ignore[index]
    out["kv_bytes_copied_per_step_dynamic_at_end"] = _kv_bytes_per_step(model, len(prompts), run_tokens)

    def ratio(a: str, b: str, key: str) -> float:
        return round(out[a][key] / out[b][key], 3)  # type: ignore[index]

    out["ratios"] = {"serve_over_generate": ratio("serve", "generate", "tokens_per_s"),
                     "serve_over_generate_per_cpu_s": ratio("serve", "generate", "tokens_per_cpu_s"),
                     "serve_over_generate_decoding": ratio("serve", "generate", "decode_tokens_per_s"),
                     "growing_over_dynamic_decoding": ratio("generate_growing", "generate", "decode_tokens_per_s")}
    return out


def run_kv_cache_bench(*, quick: bool = False, say: Callable[[str], None] = print) -> dict[str, object]:
    """Two points: the decode bench's (many sequences, short prompts: the batch dominates) and a
    long context (few sequences, long prompts: the cache dominates)."""
    import grpc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvasir.bench._decode_swarm import DECODE_MODEL
    from kvasir.swarm import LocalSwarm
    from kvasir.tiny import make_tiny_checkpoint
    from kvasir_rpc import backbone_pb2_grpc

    rounds = 1 if quick else 3
    points = {"short": (32, 1, 8), "long_context": (4, 40, 8)} if quick else \
        {"short": (128, 1, 32), "long_context": (16, 130, 24)}  # (sequences, prompt repeats, new tokens)
    out: dict[str, object] = {"model": DECODE_MODEL, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-kv-") as tmp, LocalSwarm(tmp) as sw:
        path = make_tiny_checkpoint(pathlib.Path(tmp) / "model", arch="qwen3_moe", seed=0, overrides=DECODE_MODEL)
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype="auto").eval()
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        tokenizer.padding_side = "left"
        out["experts_implementation_generate"] = model.config._experts_implementation
        most = max(n for n, _, _ in points.values())
        # The one process of this swarm: as many torch threads as this process has (a local
        # swarm gives each of its processes one).
        sw.env["KVASIR_THREADS"] = str(torch.get_num_threads())
        service = sw.start_backbone_service("serve", path, ["--max-batch", str(most)], hub=False)
        pid = sw.procs["serve"].pid
        stub = backbone_pb2_grpc.BackboneServiceStub(grpc.insecure_channel(f"127.0.0.1:{service['grpc_port']}"))
        for name, (n, repeats, tokens) in points.items():
            prompts = [f"caller {i} asks the swarm" + " and the swarm answers" * (repeats - 1) for i in range(n)]
            say(f"  {name}: {n} sequences, {tokens} new tokens each")
            out[name] = _point(model, tokenizer, stub, pid, prompts, tokens, rounds, say)
    out["ratios"] = {f"{name}_{k}": v for name in points for k, v in out[name]["ratios"].items()}  # type: ignore[index]
    return out
