"""Cache managers: which KV blocks and recurrent state slots each request holds. Pure Python, no
tensors.

GLOSSARY
- block: a fixed run of `block_size` token positions of one sequence; its attention K/V for every
  attention layer lives in one physical KV block of the pool.
- block table: a request's physical block ids, in token order (block i holds positions
  [i * block_size, (i + 1) * block_size)).
- slot: one recurrent state entry (every state tensor of every recurrent layer: a Mamba2
  layer's conv window and SSM state, a Gated DeltaNet layer's conv window and key x value state).
- live slot: the slot a running request reads and advances every step.
- snapshot: an immutable copy of a live slot taken after exactly P tokens.
"""
