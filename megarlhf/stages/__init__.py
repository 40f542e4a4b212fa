"""megarlhf.stages"""
