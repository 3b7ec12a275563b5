"""dflash.train"""
