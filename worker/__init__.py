"""The worker: serves ExpertService for its expert slices through an outbound tunnel."""

from worker._service import ExpertServicer, LoadedExperts
from worker._tunnel import run_tunnel, serve_session

__all__ = ["ExpertServicer", "LoadedExperts", "run_tunnel", "serve_session"]
