"""Write the demo target's token ranking (token ids by frequency in its training corpus), for draft vocabularies.

`LayerSkipDrafter(draft_vocab=...)` drafts from a reduced vocabulary (FR-Spec); the `demo-layer-skip` preset takes
the first `draft_vocab_size` ids of this ranking. The corpus is the demo family's training corpus
(`examples/train_demo_family.py`: Tiny Shakespeare, GSM8K train, Python standard library source).

Usage::

    python examples/rank_demo_tokens.py --data ../shared/data --out hf_speculators/demo/target/token_ranking.json
"""

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from hf_speculators.loading import DEMO_TARGET
from hf_speculators.vocab import rank_tokens
from train_demo_family import load_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path(DEMO_TARGET) / "token_ranking.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    ranking = rank_tokens(tokenizer, load_documents(args.data))
    source = ("token ids of the demo tokenizer, most frequent first, counted on the demo family's training corpus "
              "(python examples/rank_demo_tokens.py)")
    args.out.write_text(json.dumps({"source": source, "token_ids": ranking}) + "\n", encoding="utf-8")
    print(f"{len(ranking)} token ids ranked: {args.out}")


if __name__ == "__main__":
    main()
