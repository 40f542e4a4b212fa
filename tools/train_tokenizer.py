"""Train a sentencepiece tokenizer from local text files.

    python tools/train_tokenizer.py --input runs/demo/task/corpus.txt --vocab-size 100 \\
        --out runs/demo/tok2/spm

writes runs/demo/tok2/spm.model (pad=0, unk=1, bos=2, eos=3) and prints a round-trip
check.
"""

from __future__ import annotations

import argparse
import os
import sys

from megarlhf.data.tokenizer import SentencePieceTokenizer, train_sentencepiece


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="plain-text training files")
    parser.add_argument("--vocab-size", type=int, default=1000)
    parser.add_argument("--model-type", choices=["bpe", "unigram", "char", "word"],
                        default="bpe")
    parser.add_argument("--out", required=True, help="output prefix (writes PREFIX.model)")
    args = parser.parse_args(argv)
    try:
        if os.path.dirname(args.out):
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
        path = train_sentencepiece(args.input, args.out, args.vocab_size, args.model_type)
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as err:
        print(f"train_tokenizer: error: {err}", file=sys.stderr)
        return 2
    tok = SentencePieceTokenizer(path)
    with open(args.input[0]) as f:
        sample = next((line.strip() for line in f if line.strip()), "hello world")
    ids = tok.encode(sample)
    print(f"wrote {path}: vocabulary {tok.vocab_size}, bos={tok.bos_id} eos={tok.eos_id} "
          f"pad={tok.pad_id}")
    print(f"round trip: {sample[:60]!r} -> {len(ids)} tokens -> {tok.decode(ids)[:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
