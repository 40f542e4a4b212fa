"""PPO and its relatives (GRPO, RLOO, REINFORCE++): the session that builds a run's parts
and runs an iteration, the learner that updates actor and critic, and evaluation."""
