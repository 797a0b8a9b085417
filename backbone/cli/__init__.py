"""``python -m backbone``: the command line, the composition root that builds the pieces from
the flags (``generate``, ``serve``) and nothing else."""
