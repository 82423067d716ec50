"""Models: loading policies/processors, tiny local models, (later) ActorVL and the critic."""
