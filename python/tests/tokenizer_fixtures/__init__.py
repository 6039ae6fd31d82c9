"""What the tokenizer tests compare on, made (not committed): real tokenizer.json files from PyPI
packages (make_fixtures.py) and a multilingual corpus of Debian man pages (make_corpus.py)."""
