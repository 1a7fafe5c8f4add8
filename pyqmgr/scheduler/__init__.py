"""The I/O-free scheduling core.

Plain Python objects named after the structures of Postfix's scheduler (transport,
queue, entry, job, peer, message). Time is always passed in; no module here may import
``socket``, ``os``, ``time`` or ``asyncio``, so the daemon, the simulator and the unit
tests can all drive the same code.
"""
