"""lockstep's bridge to Hugging Face tokenizers: a tokenizer.json read by the maintained
`tokenizers` library. Embedded in the binary and run with $LOCKSTEP_PYTHON by `lockstep data
shard --tokenizer`, `data show` and `generate`; lockstep writes the shards itself.

    python tokenizer.py info PATH              # {"vocab_size", "eot"} as JSON
    python tokenizer.py encode PATH FILE...    # uint32 little-endian ids on stdout: each
                                               # document (file) preceded by the end-of-text id
                                               # (llm.c's convention), when the vocabulary has one
    python tokenizer.py encode-text PATH TEXT  # the same for one string, no end-of-text
    python tokenizer.py decode PATH ID,ID,...  # the text, UTF-8, on stdout

Exit 3 with one line on stderr when `tokenizers` is missing or PATH is not a tokenizer.
"""
import json
import sys

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


def load(path):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print(f"{sys.executable} cannot import tokenizers; install it there ({sys.executable} -m "
              "pip install tokenizers)", file=sys.stderr)
        sys.exit(3)
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library's own message names what is wrong
        print(f"tokenizer '{path}': not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})",
              file=sys.stderr)
        sys.exit(3)


def eot_of(tok):
    for name in EOT_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def write_ids(ids):
    out = bytearray()
    for i in ids:
        out += int(i).to_bytes(4, "little")
    sys.stdout.buffer.write(out)


def main(args):
    command, path = args[0], args[1]
    tok = load(path)
    if command == "info":
        print(json.dumps({"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                          "eot": eot_of(tok)}))
    elif command == "encode":
        eot = eot_of(tok)
        for name in args[2:]:
            with open(name, encoding="utf-8", errors="replace") as f:
                text = f.read()
            write_ids(([eot] if eot is not None else []) +
                      tok.encode(text, add_special_tokens=False).ids)
    elif command == "encode-text":
        write_ids(tok.encode(args[2], add_special_tokens=False).ids)
    elif command == "decode":
        ids = [int(x) for x in args[2].split(",") if x]
        sys.stdout.write(tok.decode(ids, skip_special_tokens=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
