"""What every pdmesh service shares: the gRPC server (health, reflection, limits, error mapping),
proto conversion at the edge, and the engine thread."""
