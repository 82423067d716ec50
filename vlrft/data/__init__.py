"""Datasets, media and the multimodal processor: from dataset rows to model-ready prompt batches.

    samples = read_samples("train.jsonl")                  # any supported layout -> Sample
    encoder = PromptEncoder(processor, cfg.data)
    batch = encoder.encode(samples[:8]).batch              # PromptBatch: ids once per prompt + VisualBatch
"""

from vlrft.data.processor import EncodeResult, PromptBatch, PromptEncoder, left_pad
from vlrft.data.readers import ReadResult, read_dataset, read_files, read_samples, read_split
from vlrft.data.sample import BadSampleError, Sample, SkippedSample
from vlrft.data.sampler import PromptSampler

__all__ = [
    "BadSampleError", "EncodeResult", "PromptBatch", "PromptEncoder", "PromptSampler", "ReadResult", "Sample",
    "SkippedSample", "left_pad", "read_dataset", "read_files", "read_samples", "read_split",
]
