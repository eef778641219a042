import sys

from shardtune.cli import main

# Guarded: spawned helper processes (tokenizer workers, DCP's async checkpoint writer) import the
# main module again and must not run the CLI.
if __name__ == "__main__":
    sys.exit(main())
