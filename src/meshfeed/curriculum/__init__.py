"""Curriculum learning: offline metric analysis, pacing schedules, difficulty-gated order.

``analyze`` builds metric indexes (``meshfeed analyze`` on the command line); the schedules map
the training step to a difficulty with DeepSpeed's definitions; ``Curriculum`` turns indexes
and schedules into the order ``meshfeed.DataLoader(curriculum=...)`` walks, with no rank-0
sampling, no files written during training and O(1) resume.
"""

from meshfeed.curriculum.analyzer import analyze
from meshfeed.curriculum.curriculum import Curriculum, CurriculumIndexWarning, CurriculumMetric
from meshfeed.curriculum.deepspeed import from_deepspeed_config
from meshfeed.curriculum.index import MetricIndex, content_fingerprint, load_accumulated
from meshfeed.curriculum.metrics import (
    AccumulatedMetric,
    SampleMetric,
    seqlen,
    token_histogram,
    vocab_rarity,
)
from meshfeed.curriculum.order import GatedOrder
from meshfeed.curriculum.schedule import custom, fixed_discrete, fixed_linear, fixed_root
from meshfeed.curriculum.transforms import ReportedDifficulty, SeqlenReshape, SeqlenTruncate

__all__ = [
    "AccumulatedMetric",
    "Curriculum",
    "CurriculumIndexWarning",
    "CurriculumMetric",
    "GatedOrder",
    "MetricIndex",
    "ReportedDifficulty",
    "SampleMetric",
    "SeqlenReshape",
    "SeqlenTruncate",
    "analyze",
    "custom",
    "content_fingerprint",
    "fixed_discrete",
    "fixed_linear",
    "fixed_root",
    "from_deepspeed_config",
    "load_accumulated",
    "seqlen",
    "token_histogram",
    "vocab_rarity",
]
