"""authority"""
