"""The OpenAI-compatible HTTP API: routes, request models and body checks, reply shaping, and
the text of a reply (incremental detokenizing, stop strings, choices). No Ray here."""
