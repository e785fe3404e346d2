"""Triton implementations of the kernels, registered with `pdmesh.kernels.backend`."""
