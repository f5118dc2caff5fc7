"""Trains a small byte-level BPE tokenizer with the maintained `tokenizers` library (offline)
and saves it as a Hugging Face tokenizer.json: the tokenizer of the `data shard --tokenizer`
tests.

    python tests/tok_train.py OUT.json VOCAB_SIZE TEXT_FILE...
"""
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


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
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
