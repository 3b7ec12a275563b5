"""dflash_pipeline.shared"""
