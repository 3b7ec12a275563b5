"""dflash_pipeline.train"""
