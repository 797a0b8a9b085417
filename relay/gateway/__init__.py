"""The public gateway: workers and hubs both dial out and are paired here; one process or N on
one port, and its metrics."""
