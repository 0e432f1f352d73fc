"""The 47B MoE (configs/olmoe3_47b.py) as a pretraining run reads in OLMo-core: data from
OLMo-core's OLMo-mix-0925-official mix file in the object store, a token budget instead of a
step count, and a warmup-stable-decay schedule counted in tokens.

The mix is read from the installed ai2-olmo-core package by name (docs/data.md#mix-files),
its paths under gs://ai2-llm (OLMo-core's default root, `internal/common.get_root_dir`) with
{TOKENIZER} = allenai/dolma3-tokenizer, as OLMo-core's OLMo 3 runs; the token files are
read by byte ranges from the bucket (docs/data.md#object-stores). Point data.mix_root at a
local or s3:// copy to train on it elsewhere. The model learns its routing
(routing_mode=learned), unlike the benchmark's random assignment."""

from configs.olmoe3_47b import olmoe3_base


def get_config():
    c = olmoe3_base(128)
    c.model.moe.routing_mode = "learned"
    d = c.data
    d.mix = "OLMo-mix-0925-official"  # olmo_core/data/mixes/OLMo-mix-0925-official.txt
    d.mix_root = "gs://ai2-llm"  # OLMo-core's mix_base_dir (get_root_dir)
    d.mix_tokenizer = "allenai/dolma3-tokenizer"  # TokenizerConfig.dolma2().identifier
    d.vocab_size = 100_278  # dolma2's vocab: uint32 token files (OLMo-core's dtype rule)
    t = c.trainer
    t.max_steps = 0  # the token budget ends the run
    t.max_tokens = 1_000_000_000_000  # Duration.tokens(1e12): 238,419 steps of 4Mi tokens
    # 2,000 steps of warmup (8,388,608,000 tokens), then stable, then a linear decay over the
    # last 10% of the tokens, OLMo-core's WSD(units=SchedulerUnits.tokens).
    c.optim.scheduler = "wsd(warmup=8_388_608_000, decay_fraction=0.1, units='tokens')"
    t.run_dir = "runs/olmoe3_47b_mix"
    return c
