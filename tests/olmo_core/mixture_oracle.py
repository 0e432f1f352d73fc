"""OLMo-core's source mixtures and mix files as the oracle (run in .venv-oracle, never
imported by the product): `python mixture_oracle.py SPEC.json OUT.json`.

SPEC: {"cases": [{"sources": [{"source_name", "paths", "target_ratio",
"max_repetition_ratio", "max_source_fraction"}], "requested_tokens", "global_batch_tokens",
"seq_len", "vocab_size", "seed", "work_dir"}]}. For each case OUT["cases"] holds either
{"error": message} (the exception each source's `validate()` or `build()` raises) or what OLMo-core's
`NumpyFSLDatasetConfig(source_mixture_config=...).build()` selects: the dataset's paths and
`path_offset_index` token counts in order ("entries"), each source's outcome-table numbers
(population, num_selected), the dtype, and every instance's input_ids. SPEC's "mix":
{"name", "base_dir", "tokenizer"} gives OUT's "mix": {"mixes_dir": the folder OLMo-core
reads its shipped mixes from, "paths", "labels"} of `DataMix(name).build(base_dir,
TokenizerName(tokenizer))`."""

import json
import sys
from pathlib import Path

import numpy as np
import olmo_core
from olmo_core.data.mixes import DataMix
from olmo_core.data.numpy_dataset import NumpyFSLDatasetConfig
from olmo_core.data.source_mixture import (
    SourceMixtureConfig,
    SourceMixtureDatasetConfig,
    SourceMixtureList,
)
from olmo_core.data.tokenizer import TokenizerConfig, TokenizerName


def run_case(case: dict) -> dict:
    mix = SourceMixtureDatasetConfig(
        source_list=SourceMixtureList(sources=[SourceMixtureConfig(**s) for s in case["sources"]]),
        requested_tokens=case["requested_tokens"],
        global_batch_size=case["global_batch_tokens"],
        seed=case["seed"], render_tables=False, quiet=True)
    tokenizer = TokenizerConfig(vocab_size=case["vocab_size"], eos_token_id=0, pad_token_id=0)
    config = NumpyFSLDatasetConfig(tokenizer=tokenizer, sequence_length=case["seq_len"],
                                   source_mixture_config=mix, work_dir=case["work_dir"])
    try:
        for source in mix.source_list.sources:  # build() checks only the list (ratios sum)
            source.validate()
        outcome = mix.build(npdtype=config.get_dtype(), sequence_length=case["seq_len"])
        details = []
        for source in mix.source_list.sources:
            population = mix._count_tokens_for_paths(
                source.resolved_paths, source.source_name, config.get_dtype())
            details.append({"source_name": source.source_name, "population": population,
                            "num_selected": int(case["requested_tokens"] * source.target_ratio)})
        dataset = config.build()
    except Exception as e:  # noqa: BLE001 - the oracle reports OLMo-core's error as data
        return {"error": f"{type(e).__name__}: {e}"}
    dataset.prepare()
    entries = [[str(p), dataset._path_offset_index[(str(p), i)]]
               for i, p in enumerate(dataset.paths)]
    rows = np.stack([dataset[i]["input_ids"].numpy() for i in range(len(dataset))])
    return {"entries": entries, "details": details, "dtype": np.dtype(config.get_dtype()).name,
            "outcome_tokens": {o.name: sum(p.tokens for p in o.path_tokens)
                               for o in outcome.sources},
            "input_ids": rows.astype(np.int64).tolist()}


def build_mix(name: str, base_dir: str, tokenizer: str) -> dict:
    paths, labels = DataMix(name).build(base_dir, TokenizerName(tokenizer))
    mixes_dir = Path(olmo_core.__file__).parent / "data" / "mixes"
    return {"mixes_dir": str(mixes_dir), "paths": paths, "labels": labels}


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    with open(out_path, "w") as f:
        json.dump({"cases": [run_case(case) for case in spec["cases"]],
                   "mix": build_mix(**spec["mix"])}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
