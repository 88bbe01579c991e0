"""The one agent loop shared by cloud tasks (webapp.agents) and RL rollouts (training.rl).

``loop.run_agent`` drives a policy (``policy.OpenAIChatPolicy`` for any OpenAI-compatible server,
including Flowstate's own ``/v1/chat/completions``; ``scripted.ScriptedExpertPolicy`` for a
deterministic scripted expert) against a sandbox through ``sandboxes.tools`` and reports every step
as an event dict, so a product task and a training rollout produce the same trace.
"""
