"""Routing: which engine prefills a request and which decodes it (`router`), scored by the
global prefix index of every engine's cached blocks and snapshots (`prefix_index`)."""
