"""Decoding: loading a checkpoint for decoding, greedy decoding of one batch, the continuous
batch many callers share, and assisted (speculative) decoding."""
