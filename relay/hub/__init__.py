"""The hub: worker sessions and their handshake, the gRPC targets the backbones reach them by,
the registry of who holds what, admission, the planner, paid work and receipts, the link to a
gateway, and the operator's status page."""
