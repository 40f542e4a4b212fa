"""Memory: what each role holds per phase, measured (accounting) and predicted (plan)."""
