"""Write a tokenizer and a text dataset for TorchTitan's debug model, offline.

torchtitan's wheel ships neither its test tokenizer (``tests/assets/tokenizer``) nor its
``c4_test`` data, and nothing here may be downloaded at run time, so this writes both:

- ``OUT/tokenizer/``: ``tokenizer.json`` (a word-level tokenizer built with the ``tokenizers``
  package torchtitan already depends on: 64 words, 4 special tokens, vocabulary < the debug
  model's 2048) and ``tokenizer_config.json`` naming its BOS/EOS tokens, which torchtitan's
  ``HuggingFaceTokenizer`` reads;
- ``OUT/data/train.json``: JSON lines ``{"text": ...}`` (deterministic pseudo-sentences), the
  layout of torchtitan's ``c4_test`` dataset, loaded with ``datasets.load_dataset(dir,
  split="train")``.

Usage: ``python make_assets.py OUT [--docs N]``; prints the two paths as JSON. Fails (exit 1, one
line) if the ``tokenizers`` package is missing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

WORDS = ("the a one two three four five six seven eight nine ten lighthouse quorum replica group "
         "rank step commit gradient loss model layer token batch shard reduce gather all fast "
         "slow late early wait train heal join leave evict monitor server flight recorder "
         "trace node host pod job run stop start tensor cpu gpu gloo nccl store manager time "
         "data text word").split()
BOS, EOS, UNK, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<unk>", "<pad>"


def write_tokenizer(out: Path) -> Path:
    try:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace
    except ImportError as e:
        raise SystemExit(f"make_assets: the 'tokenizers' package is needed ({e})") from None
    vocab = {tok: i for i, tok in enumerate([UNK, PAD, BOS, EOS, *dict.fromkeys(WORDS), "."])}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([BOS, EOS, PAD])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
         "add_bos_token": False, "add_eos_token": False,
         "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def write_data(out: Path, docs: int) -> Path:
    rng = random.Random(0)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.json", "w") as f:
        for _ in range(docs):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))) + " ."
                         for _ in range(rng.randint(3, 10))]
            f.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--docs", type=int, default=2000)
    args = p.parse_args(argv)
    tok = write_tokenizer(args.out / "tokenizer")
    data = write_data(args.out / "data", args.docs)
    print(json.dumps({"tokenizer": str(tok), "data": str(data)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
