"""Command lines: ``nccltree-train``, ``nccltree-bench``, ``nccltree-data``.

Each is thin: it parses, calls the library and prints. ``main(argv=None) -> int`` in each
module is the entry point.
"""
