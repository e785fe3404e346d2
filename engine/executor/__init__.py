"""Where a worker's follower ranks run (`distributed_executor_backend`, vLLM's name): local
processes (`mp`, also across nodes as a static launch) or Ray actors (`ray`)."""
