"""megarlhf.data"""
