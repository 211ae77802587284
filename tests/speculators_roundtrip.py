"""Loads an EAGLE-3 head saved by hf_speculators with vllm-project/speculators' own `Eagle3DraftModel` and checks
that it drafts the same first tokens as ours. Run with the Python of an environment where speculators 0.9 is
installed (it is kept out of this project's dependencies), e.g. one made by `tests/make_speculators_env.sh`:

    /tmp/specvenv/bin/python tests/speculators_roundtrip.py HEAD_FOLDER CASE.safetensors

`CASE.safetensors` holds `features` `(1, P, 3H)` (the target's aux-layer inputs), `input_ids` `(1, P)` (the tokens
x_{t+1} paired with them), `embed_tokens` (the target's embeddings) and `draft_ids` `(1, P)`, our head's argmax draft
ids of each pair. Prints one JSON line and exits 0 when speculators agrees on every position and its loaded
`embed_tokens` equals the target's, 1 otherwise.
"""

import json
import sys

import torch
from safetensors.torch import load_file
from speculators.models.eagle3 import Eagle3DraftModel


def main(folder: str, case_path: str) -> int:
    torch.manual_seed(0)
    case = load_file(case_path)
    model = Eagle3DraftModel.from_pretrained(folder).float().eval()
    num_pairs = case["input_ids"].shape[1]
    with torch.no_grad():
        drafts = model(hidden_states=case["features"], input_ids=case["input_ids"],
                       document_ids=torch.zeros(1, num_pairs, dtype=torch.long),
                       position_ids=torch.arange(num_pairs)[None], ttt_steps=1)
    agree = int((drafts[0] == case["draft_ids"]).sum())
    embed_equal = bool(torch.equal(model.embed_tokens.weight.float(), case["embed_tokens"].float()))
    print(json.dumps({"agree": agree, "positions": num_pairs, "embed_tokens_equal": embed_equal}))
    return 0 if agree == num_pairs and embed_equal else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
