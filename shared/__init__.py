"""dflash.shared"""
