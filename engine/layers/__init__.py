"""Model building blocks; parallel-aware, backed by `pdmesh.kernels`."""
