"""CPU kernels in C and C++: prompt scan, decode state update, decode attention, small-batch
mat-vec, the native decode step, and the torch operators over them. `library` builds and
caches them; the modules beside it are their Python bindings."""
