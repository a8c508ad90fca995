"""What runs inside an engine actor around the engine: `EngineHost` (the stepping thread and
request streams), transfer links, cache events to the router, and CPU core binding. Plain
classes, tested without Ray; `control.actors` wraps them."""
