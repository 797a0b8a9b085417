"""Developer tooling behind the ``kvasir`` command: checks, benchmarks, local swarms."""
