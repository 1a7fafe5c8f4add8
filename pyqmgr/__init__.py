"""pyqmgr: Postfix's queue manager, in Python.

Layers, from the inside out:

* ``pyqmgr.scheduler`` - the I/O-free scheduling core (transports, destination queues,
  jobs, peers, entries, messages, concurrency feedback). It takes events and returns
  decisions; it never touches a socket, a file or the clock.
* ``pyqmgr.postfix`` - everything that speaks Postfix: the attribute protocol, queue
  files and directories, main.cf, the master protocol, logging, and the clients of
  trivial-rewrite, the delivery agents and bounce/defer/trace.
* ``pyqmgr.daemon`` - the asyncio program master(8) starts as the qmgr service; it feeds
  the core from queue scans and agent replies and carries out its decisions.
* ``pyqmgr.testbed`` - throwaway Postfix instances and a sink SMTP server, for tests,
  the demo and benchmarks.
"""

__version__ = "0.1.0"
