"""dflash_pipeline.extract"""
