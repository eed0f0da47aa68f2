"""The native kernels (C++ CPU sources) and `cpp_build`, which compiles them. The bottom
of the dependency graph: imports nothing of pkv's."""
