"""The node side: what runs on each Ray node (the agent, model loading, the replica actor, the watchdog)."""
