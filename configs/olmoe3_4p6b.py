"""The 47B benchmark model's shape with 8 experts (~4.6B total parameters): the
reference's comparison point for "128 vs 8 experts costs < 5% throughput"."""

from configs.olmoe3_47b import olmoe3_base


def get_config():
    return olmoe3_base(8)
