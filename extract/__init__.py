"""dflash.extract"""
