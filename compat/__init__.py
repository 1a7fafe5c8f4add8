"""Side-by-side comparison of pyqmgr with stock qmgr (see compat/README.md)."""
