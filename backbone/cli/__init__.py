"""``python -m backbone``: the command line, the composition root that builds the pieces from
the flags and nothing else: the parser here, what both commands build in ``_setup`` (the
model and its expert path, typed), the commands in ``_generate`` and ``_serve``."""

from __future__ import annotations

import argparse
import pathlib

from backbone.cli._generate import add_assist_args
from backbone.cli._setup import add_ceiling_args, add_experts_args
from kvasir_rpc import HelpFormatter, configure_logging

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m backbone`` (generate and serve)."""
    parser = argparse.ArgumentParser(prog="python -m backbone", formatter_class=HelpFormatter,
                                     description="The backbone: dense layers and the router here, experts on a "
                                                 "hub's workers.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="greedy decode with experts on the swarm", formatter_class=HelpFormatter,
                       description="Greedy decode of --prompt, the text printed as it comes (with --json: one JSON "
                                   "object as the last line of stdout, a progress bar on a terminal's stderr).")
    add_experts_args(g)
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens decoded per sequence")
    g.add_argument("--max-seconds", type=float, default=None,
                   help="end the decode after this many seconds (the tokens so far; Ctrl-C does the same)")
    g.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    g.add_argument("--compare-local", action="store_true",
                   help="also decode with every expert local and compare: the verdict is 'bitwise equal' or 'within "
                        "the audit bound, tokens identical' (exit 0 for both), or 'tokens differ' (exit 1)")
    g.add_argument("--require-bitwise", action="store_true",
                   help="with --compare-local, pass only when every logit is bitwise the local run's (runs on one "
                        "machine, bit-exact wire): 'within the audit bound' then exits 1")
    g.add_argument("--groups", default="1",
                   help="micro-batch pipelining: decode this many groups of sequences concurrently so one "
                        "computes while others wait on the network; 'auto' picks from a measured remote "
                        "step and a local one")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    add_assist_args(g)
    add_ceiling_args(g)
    sv = sub.add_parser("serve", help="serve kvasir.v1.BackboneService (gRPC) and the OpenAI-compatible HTTP API",
                        formatter_class=HelpFormatter)
    add_experts_args(sv)
    sv.add_argument("--listen", default="127.0.0.1:50061", help="HOST:PORT for gRPC (port 0 picks a free one)")
    sv.add_argument("--http", help="HOST:PORT for the OpenAI-compatible HTTP API and Prometheus metrics at "
                                   "/metrics (off without it). /metrics and /health need no API key: they "
                                   "hold counters only, never a prompt or a token")
    sv.add_argument("--model-name", help="the model's id in ListModels and the HTTP API (default: the --model folder's name)")
    sv.add_argument("--max-batch", type=int, default=32, help="requests decoded together at most")
    sv.add_argument("--max-waiting", type=int, default=64,
                    help="requests waiting for a slot at most; more get RESOURCE_EXHAUSTED (HTTP 429)")
    sv.add_argument("--lanes", type=int, default=1,
                    help="micro-batch pipelining: the batch is split into this many lanes, each its own thread, so "
                         "one computes while another waits on remote experts (with a hub, 2 lanes gave 1.3 to 1.7 "
                         "times the tokens/s of 1 at 32 callers in kvasir bench --service)")
    sv.add_argument("--max-tokens-limit", type=int, default=None,
                    help="max_tokens a request may ask for at most (default: the model's context)")
    sv.add_argument("--max-prompt-bytes", type=int, default=None, metavar="BYTES",
                    help="a prompt's text (a chat's messages together) larger than this in UTF-8 is refused "
                         "before it is tokenized: INVALID_ARGUMENT, HTTP 400 (default: 16 bytes per token of the "
                         "model's context, at most 2 MiB). The HTTP body limit is 1 MiB, or 4 times this if more; "
                         "gRPC refuses a message over 4 MiB, or what a valid request may take if more")
    sv.add_argument("--http-timeout", type=float, default=30.0, metavar="SECONDS",
                    help="an HTTP connection that sends no complete request head for this long (idle, or slow "
                         "to send one) is closed, and a request whose body has not all arrived after it gets 408")
    sv.add_argument("--api-key-file", type=pathlib.Path,
                    help="callers must present the key in this file (created, mode 0600, if missing) as a bearer "
                         "token: gRPC 'authorization: Bearer KEY' metadata, HTTP 'Authorization: Bearer KEY' (the "
                         "openai package's api_key). Needed when --listen or --http is beyond loopback, unless "
                         "--no-auth")
    sv.add_argument("--no-auth", action="store_true",
                    help="serve without an API key on an address beyond loopback: anyone who reaches --listen "
                         "or --http may generate (on loopback no key is needed)")
    sv.add_argument("--ready-file", type=pathlib.Path,
                    help="write {grpc_port, http_port, model} here (atomically) once serving")
    return parser



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging("backbone", level=args.log_level)
    if args.command == "serve":
        from backbone.cli._serve import run_serve

        return run_serve(parser, args)
    from backbone.cli._generate import run_generate

    return run_generate(parser, args)
