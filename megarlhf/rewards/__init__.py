"""Everything that runs the user's code: reward functions (in worker processes, in the
trainer or behind a server) and environments, each call with its deadline and its
failure rules. Worker processes start as ``python -m megarlhf.rewards.<worker>``."""
