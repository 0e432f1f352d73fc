"""The 8-expert point of the reference's headline scaling result: the 47B benchmark model
with TECH_REPORT_NUM_EXPERTS=8 (4.6B total; the same config as configs/olmoe3_4p6b.py)."""

from configs.olmoe3_47b import olmoe3_base


def get_config():
    return olmoe3_base(8)
