"""Delivery events (issue #46): one structured record per recipient per delivery attempt.

Pure code, imported only where events are written or checked: nothing here reads a file
or starts anything at import. :mod:`pyqmgr.events.categories` says what a reply means.
"""
