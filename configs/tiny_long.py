"""A tiny long-context run on 8 devices (fake CPU ones: XLA_FLAGS=
--xla_force_host_platform_device_count=8): configs/tiny.py with each sequence split over
parallel.context = 4 devices (zig-zag shards, ring attention) x parallel.expert = 2,
documents masked (data.doc_mask) and sliding windows of 64 tokens in three of every four
layers (OLMo 3's pattern shape: model.window_pattern (64, 64, 64, -1), the last layer
full). Trained a few steps by tests/test_long_context_config.py."""

from configs.tiny import get_config as tiny_config


def get_config():
    c = tiny_config()
    m = c.model
    m.window_pattern = (64, 64, 64, -1)
    m.window_full_first = False
    m.window_full_last = True
    c.data.doc_mask = True
    c.parallel.context = 4
    c.parallel.expert = 2
    c.parallel.data = -1
    c.trainer.run_dir = "runs/tiny_long"
    return c
