"""One rank's model runner: the only code that builds tensors. It applies a step plan's cache
ops to the pools (`cache_memory`, `host_memory`), runs the forward pass through the first
forward path that accepts the step (`paths/`), and samples (`sampler`)."""
