"""The 47B benchmark model's shape with 8 experts (~4.6B total parameters): the
reference's comparison point for "128 vs 8 experts costs < 5% throughput"
(moe_8l_ddp.py with TECH_REPORT_NUM_EXPERTS=8; every other value as configs/olmoe3_47b.py).
configs/olmoe3_47b_8e.py is the same config under the name of that point."""

from configs.olmoe3_47b import olmoe3_base


def get_config():
    return olmoe3_base(8)
