"""``kvasir conformance``: drive a worker through everything a hub and a backbone ask of it
and report each step, so someone writing a worker (in any language) knows when it is done.

The check is a hub: a plain ``ws://`` server that the worker, a stranger, dials out to
(``--hub ws://HOST:PORT`` for the Python worker). With ``--worker-cmd`` it starts the worker
itself and stops it at the end. Over that one WebSocket it runs, in order:

    upgrade     the worker offers the subprotocol kvasir.tunnel.v1
    handshake   SessionChallenge -> SessionHello (signature, nonce, limits) -> SessionAccept
    idle        nothing comes from the worker while no connection is open
    digest      the announced weights digest is the checkpoint's digest of the announced slices
    open        on "open" the worker dials its gRPC server: HTTP/2 bytes come back
    describe    Describe answers, and agrees with the hello
    dispatch    seeded random calls (several experts, several rows, a packed call with
                row_index), every output row against the reference kernel on the checkpoint
    errors      malformed calls get the gRPC status the spec names; the connection stays up
    close       "close" is answered with "closed" within CLOSE_TIMEOUT_S
    reconnect   a second "open" gives a fresh HTTP/2 connection (Describe again), then closes
    keepalive   a WebSocket ping is answered with a pong within KEEPALIVE_TIMEOUT_S, and on an
                encrypted session a sealed heartbeat with its ack within the same time

The package: ``_hub`` plays the hub's side (the I/O: the WebSocket, the handshake, the
tunnel's reader, the gRPC target spliced into it); ``_steps`` holds the steps and their
table; ``_calls`` the calls sent, ``_judge`` how their answers are judged; ``_results`` what
is reported; ``_cli`` the command line and ``run_check``.
"""

from kvasir.conformance._calls import plan_calls
from kvasir.conformance._cli import add_parser, run, run_check
from kvasir.conformance._judge import judge_partials, judge_projections
from kvasir.conformance._results import FAIL, PASS, SKIP, StepResult
from kvasir.conformance._steps import CALL_TIMEOUT_S, IDLE_WATCH_S, OPEN_TIMEOUT_S, STEPS

__all__ = ["PASS", "FAIL", "SKIP", "STEPS", "StepResult", "add_parser", "judge_partials", "judge_projections",
           "plan_calls", "run", "run_check", "CALL_TIMEOUT_S", "IDLE_WATCH_S", "OPEN_TIMEOUT_S"]
