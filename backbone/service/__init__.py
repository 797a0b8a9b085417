"""The service front: kvasir.v1.BackboneService over gRPC, the OpenAI-compatible HTTP API, the
OpenAI shapes (without I/O) and the service's metrics."""
