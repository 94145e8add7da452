"""The release, in one place (pyproject.toml holds the same string; tests/test_cli.py checks they agree)."""
__version__ = "0.1.0"
