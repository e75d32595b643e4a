"""Shared test set-up. Being here, this file puts tests/ on the import path (pytest's default `prepend`
import mode), so every test file imports the shared helpers the same way: `from tiny import ...` (the tiny
models) and `from helpers import ...` (data makers and header-only checkpoints)."""
