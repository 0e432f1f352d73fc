"""OLMo-core's mix files as the oracle (run in .venv-oracle, never imported by the product):
`python mix_oracle.py NAME BASE_DIR TOKENIZER OUT.json` writes {"mixes_dir": the folder
OLMo-core reads its shipped mixes from, "paths": [...], "labels": [...]} of
`DataMix(NAME).build(BASE_DIR, TOKENIZER)`."""

import json
import sys
from pathlib import Path

import olmo_core
from olmo_core.data.mixes import DataMix
from olmo_core.data.tokenizer import TokenizerName


def main(name: str, base_dir: str, tokenizer: str, out_path: str) -> None:
    paths, labels = DataMix(name).build(base_dir, TokenizerName(tokenizer))
    mixes_dir = Path(olmo_core.__file__).parent / "data" / "mixes"
    Path(out_path).write_text(json.dumps({"mixes_dir": str(mixes_dir), "paths": paths,
                                          "labels": labels}))


if __name__ == "__main__":
    main(*sys.argv[1:])
