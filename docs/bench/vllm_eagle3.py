"""vLLM's greedy output with a specjax-trained published EAGLE-3 head against specjax's plain decoding, and
specjax's own speculation with the same head (docs/bench/vllm_eagle3.sh runs it: URL HEAD)."""
import json
import sys
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
import specjax  # noqa: E402
from serve_load import prompts  # noqa: E402

url, head = sys.argv[1], sys.argv[2]
target = specjax.load_model(str(ROOT / "checkpoints/target"))
tok = specjax.load_tokenizer(str(ROOT / "checkpoints/target"))
texts = prompts(16)
same = 0
drafter = specjax.load_drafter(head)
for t in texts:
    ids = tok.encode(t)
    ids = ids.ids if hasattr(ids, "ids") else ids
    r = httpx.post(url + "/v1/completions", json={"model": "checkpoints/target", "prompt": ids, "max_tokens": 48,
                                                  "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                   timeout=300).json()
    got = r["choices"][0].get("token_ids")
    p, lengths = np.array([ids], np.int32), np.array([len(ids)], np.int32)
    plain = specjax.generate(target, p, lengths, max_new_tokens=48)
    spec = specjax.generate(target, p, lengths, draft=drafter, max_new_tokens=48, num_draft_tokens=3)
    want = np.asarray(plain.tokens[0, :plain.num_tokens[0]]).tolist()
    mine = np.asarray(spec.tokens[0, :spec.num_tokens[0]]).tolist()
    same += got == want
    print(json.dumps({"vllm_eagle3_equals_plain": got == want, "specjax_eagle3_equals_plain": mine == want,
                      "specjax_accepted": int(spec.stats.accepted.sum()),
                      "specjax_drafted": int(spec.stats.drafted.sum())}))
print(f"vLLM with the specjax-trained head equals specjax's plain greedy output on {same} of {len(texts)} prompts")
