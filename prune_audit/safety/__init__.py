"""Input and output safety shared by every command: what a command may read (``inputs``), directory
ownership, no writes through links, write locks, atomic writes, interrupt and disk-full reporting, content
fingerprints and safe file names.

This package sits below ``cli/``, ``runner/`` and ``analysis/`` and imports only
``prune_audit.errors``, so every command uses the same mechanisms.
"""
