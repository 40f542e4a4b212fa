"""megarlhf.models"""
