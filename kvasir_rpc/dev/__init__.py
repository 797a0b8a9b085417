"""Development tooling around the library: the ``kvasir`` command (``cli``), the local-swarm
launcher (``swarm``), benchmarks (``bench``), tiny random checkpoints (``tiny``), development
certificates (``certs``), a latency proxy (``latency``), processes' CPU time (``cpu``) and the
conformance check for workers (``conformance``).

Nothing in the library proper or in the components imports this package (tests/test_repo.py
checks it); it uses only the library's public names and starts components as processes.
Import the modules themselves, e.g. ``from kvasir_rpc.dev.tiny import make_tiny_checkpoint``.
"""
