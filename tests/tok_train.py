"""Trains a small byte-level BPE tokenizer with the maintained `tokenizers` library (offline)
and saves it as a Hugging Face tokenizer.json: the tokenizer of the `data shard --tokenizer`
tests.

    python tests/tok_train.py OUT.json VOCAB_SIZE TEXT_FILE...
    python tests/tok_train.py OUT.json --wide VOCAB_SIZE TEXT_FILE...

--wide builds a word-level vocabulary of VOCAB_SIZE entries (the texts' words first, then
fillers) instead: larger than uint16 holds, in a second, for the uint32 shard path.
"""
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def wide(out, vocab, files):
    words = {"<|endoftext|>": 0, "[UNK]": 1}
    for name in files:
        for w in open(name, encoding="utf-8").read().split():
            words.setdefault(w, len(words))
    for i in range(len(words), vocab):
        words[f"filler{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(out)
    print(f"{out}: vocabulary {tok.get_vocab_size()}")


def main(out, vocab, files):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    tok.save(out)
    print(f"{out}: vocabulary {tok.get_vocab_size()}")


if __name__ == "__main__":
    if sys.argv[2] == "--wide":
        wide(sys.argv[1], int(sys.argv[3]), sys.argv[4:])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
