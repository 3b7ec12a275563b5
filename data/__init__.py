"""dflash_pipeline.data: reading chat/text records, chat templates and loss masks, the sample corpus.

The tiny random target for tests and the demo is in `dflash_pipeline.data.tiny_target` (not imported here:
it pulls in transformers and torch).
"""

from .errors import DataError
from .fingerprint import data_fingerprint, tokenizer_fingerprint
from .locations import load_sharegpt_package_path, sample_corpus_path
from .records import ReadStats, Record, data_files, iter_records
from .tokens import TokenizedSample, tokenize_record, tokenize_records

__all__ = [
    "DataError",
    "ReadStats",
    "Record",
    "TokenizedSample",
    "data_files",
    "data_fingerprint",
    "iter_records",
    "load_sharegpt_package_path",
    "sample_corpus_path",
    "tokenize_record",
    "tokenize_records",
    "tokenizer_fingerprint",
]
