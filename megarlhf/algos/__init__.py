"""megarlhf.algos"""
