"""The 1.2T model's shape with 256 experts: 2.3795T total / 58.41B active."""

from configs.olmoe3_1p2t import olmoe3_large


def get_config():
    return olmoe3_large(256)
