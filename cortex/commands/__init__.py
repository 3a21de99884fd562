"""One module per CLI command; `cortex/cli.py` registers them."""
