"""The control channel into the running daemon: its format, shared by daemon and client.

The daemon's server side lives in :mod:`pyqmgr.daemon.control`; the ``pyqmgr status``
and ``pyqmgr explain`` commands use :mod:`pyqmgr.control.client`.
"""
