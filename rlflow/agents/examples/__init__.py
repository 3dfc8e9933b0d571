"""Example agents written as plain code (rollout.agent.fn)."""
