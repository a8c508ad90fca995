"""The Ray control plane, and the only package that imports Ray: the engine and router actors,
the Coordinator that starts and supervises them, rank actors of tensor-parallel engines, the
Serve application (`app.build_app`) and starting Ray and the service from a process
(`local`)."""
