"""megarlhf.rollout"""
