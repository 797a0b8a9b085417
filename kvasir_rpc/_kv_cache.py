"""A KV cache that grows in place: transformers' ``DynamicCache`` with its attention layers'
keys and values kept at the front of a buffer with room for the tokens to come.

transformers' ``DynamicLayer`` appends each step's keys and values with ``torch.cat``: a new
tensor the size of the whole cache every step, so each step copies every token held (on the
decode bench's model, 128 sequences at 60 tokens: 60 MB a step, 6% of its CPU, and growing with
the context). ``GrowingLayer`` writes the new tokens into its buffer and hands attention a view
of the tokens so far (the same values and shape; only the batch and head strides differ), and
allocates a larger buffer only when the room runs out: room for the tokens the caller said to
expect (a decode knows its prompt and its new tokens: one buffer for the run), else an eighth
again as many tokens as held and at least ``ROOM_TOKENS`` (a copy every few dozen steps instead
of one per step, for at most an eighth more memory than the tokens held).

Whoever replaces ``keys`` or ``values`` (cropping, selecting rows, batching two caches: the
engine does all three) needs to tell no one: a layer whose tensors are not the front of its
buffer any more adopts them, copying them into a new buffer, on its next update. A view that
is still the front of the buffer (what ``crop`` leaves) is kept, and the next tokens overwrite
what was cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from transformers import DynamicCache

__all__ = ["ROOM_TOKENS", "GrowingLayer", "growing_cache"]

# Room added beyond what a buffer must hold when it is (re)allocated: at least this many tokens,
# and at least an eighth of the tokens it holds.
ROOM_TOKENS = 64
ROOM_FRACTION = 8


class GrowingLayer(DynamicLayer):
    """An attention layer's keys and values, ``[batch, heads, tokens, head_dim]`` views of the
    front of buffers with room to grow along ``tokens``."""

    def __init__(self, expected_tokens: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.expected_tokens = expected_tokens  # the first buffer holds this many (0: unknown)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self.reallocations = 0  # buffers allocated so far (the first included)

    @staticmethod
    def _front_of(view: torch.Tensor | None, buffer: torch.Tensor | None, tokens: int) -> bool:
        """Whether ``view`` is the first ``view.shape[-2]`` tokens of ``buffer`` and ``tokens``
        more fit behind them."""
        if view is None or buffer is None or view.dim() != 4:
            return False
        return (view.data_ptr() == buffer.data_ptr() and view.shape[:2] == buffer.shape[:2]
                and view.shape[-1] == buffer.shape[-1] and view.stride() == buffer.stride()
                and view.dtype == buffer.dtype and view.shape[-2] + tokens <= buffer.shape[-2])

    def _allocate(self, held: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """A buffer for ``held`` (copied in; None: nothing held) and room beyond ``new``."""
        n = held.shape[-2] if held is not None else 0
        need = n + new.shape[-2]
        shape = list(new.shape)
        first = self.reallocations == 0 and need <= self.expected_tokens
        shape[-2] = self.expected_tokens if first else need + max(ROOM_TOKENS, need // ROOM_FRACTION)
        buffer = torch.empty(shape, dtype=new.dtype, device=new.device)
        if held is not None and n:
            buffer[..., :n, :].copy_(held)
        return buffer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        add = key_states.shape[-2]
        held_keys = self.keys if self.keys is not None and self.keys.dim() == 4 else None
        held_values = self.values if self.values is not None and self.values.dim() == 4 else None
        n = held_keys.shape[-2] if held_keys is not None else 0
        if not (self._front_of(held_keys, self._key_buffer, add)
                and self._front_of(held_values, self._value_buffer, add)
                and (held_values.shape[-2] if held_values is not None else 0) == n):
            self._key_buffer = self._allocate(held_keys, key_states)
            self._value_buffer = self._allocate(held_values, value_states)
            self.reallocations += 1
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., n:n + add, :].copy_(key_states)
        self._value_buffer[..., n:n + add, :].copy_(value_states)
        self.keys = self._key_buffer[..., :n + add, :]
        self.values = self._value_buffer[..., :n + add, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def growing_cache(config: Any, expected_tokens: int = 0) -> DynamicCache:
    """``DynamicCache(config=config)`` with each plain attention layer a ``GrowingLayer``
    (sliding-window and linear-attention layers as transformers makes them), whose first
    buffer holds ``expected_tokens`` when they fit (0: no guess)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(expected_tokens) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
