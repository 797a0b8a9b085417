"""The expert path: the Dispatcher plugged into transformers' experts, where each expert runs
(placement, links to the workers, deadlines), whose weights, the checks every answer passes
before it is used (whole-answer checks, row checks, audits), the decode attempts that replay
when a worker is caught, and the work and quarantines reported to the hub."""
