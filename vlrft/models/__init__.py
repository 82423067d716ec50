"""Models: loading policies/processors, tiny local models, ActorVL (the policy's logprobs) and CriticVL."""
