"""The ``kvasir`` command and the tooling around the library: the command itself (``cli``:
``python -m kvasir``), the local-swarm launcher (``swarm``), benchmarks (``bench``), tiny random
checkpoints (``tiny``, ``families``), development certificates (``certs``), a latency proxy
(``latency``), processes' CPU time (``cpu``) and the conformance check for workers
(``conformance``).

Built on the library's public names only; it starts the components as processes and meets
them over the wire, and neither the library nor a component imports it (tests/test_repo.py).
Import the modules themselves, e.g. ``from kvasir.tiny import make_tiny_checkpoint``.
"""
