"""Everything that knows about Ray or about more than one engine.

At this root: the request flow (`orchestrator`), the messages between processes (`messages`),
the service's configuration (`config`), its metrics (`metrics`) and the command line (`cli`).
The subsystems are packages: `openai` (the HTTP API), `routing` (router and global prefix
index), `engine_host` (what runs inside an engine actor), `transport` (token feeds between
ingress and engines) and `control` (Ray: actors, the Coordinator, the Serve application).
docs/structure.md has the whole map.
"""
