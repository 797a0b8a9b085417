"""python -m relay hub --listen HOST:PORT --grpc HOST:PORT [--key PATH] [--backbone-token-file PATH]
    [--model DIR | --layers N --experts M] [--gateway wss://HOST:PORT ...]
python -m relay gateway --listen HOST:PORT --cert PEM --key PEM --hub-token-file FILE

A mistake the operator must fix before starting again (a flag, a missing or unreadable file,
a port in use or needing privileges, a gateway that refuses the hub's token or whose
certificate is not trusted) ends the command with one line naming the flag and the fix, and
exit status 2 (kvasir_rpc.fail)."""

from __future__ import annotations

import argparse

from kvasir_rpc import HelpFormatter, run_main
from relay.gateway._cli import add_gateway_command, check_gateway_args
from relay.hub._cli import add_hub_command


def build_parser() -> argparse.ArgumentParser:
    """The command line, every sub-command's arguments with their help and defaults."""
    parser = argparse.ArgumentParser(prog="python -m relay", formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, help="which service to run")
    add_hub_command(sub)
    add_gateway_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "gateway":
        check_gateway_args(parser, args)
    return int(args.func(args))


if __name__ == "__main__":
    run_main("relay", main)
