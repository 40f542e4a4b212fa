"""megarlhf.engine"""
