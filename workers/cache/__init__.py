"""Cache managers: which KV blocks and Mamba slots each request holds. Pure Python, no tensors.

GLOSSARY
- block: a fixed run of `block_size` token positions of one sequence; its attention K/V for every
  attention layer lives in one physical KV block of the pool.
- block table: a request's physical block ids, in token order (block i holds positions
  [i * block_size, (i + 1) * block_size)).
- slot: one Mamba state entry (conv window + SSM state for every Mamba layer).
- live slot: the slot a running request reads and advances every step.
- snapshot: an immutable copy of a live slot taken after exactly P tokens.
"""
