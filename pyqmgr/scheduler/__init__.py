"""The I/O-free scheduling core.

Plain Python objects named after the structures of Postfix's scheduler (transport,
queue, entry, job, peer, message). Time is always passed in; no module here may import
``socket``, ``os``, ``time`` or ``asyncio``, so the daemon, the simulator and the unit
tests can all drive the same code.

What lives where, as ``qmgr.h`` says it for stock's ``src/qmgr/``:

- ``structures``: the structures that name each other (``Entry``, ``Queue``,
  ``Transport``, ``Dsn``) and ``Backend``, what the core asks of a policy;
  ``message``: a message's scheduling state, its recipients and their routes;
- ``core``: ``Scheduler``, the state (``state.Core`` is how the verbs see it) and one
  method per event, each returning a ``decisions.Decisions`` value;
- the verbs, beside what they change: ``entry`` (select, unselect, finish, move),
  ``queue`` (queues into and out of core), ``transport`` (agent allocation),
  ``reading`` (how many recipients to read, filing them), ``deliver`` (an agent's entry
  and its reply's feedback), ``defer`` (dead destinations and transports), ``enable``
  (reviving them), ``gates`` (suspensions' and shaping's gates), ``controls`` (suspend,
  resume, retry), ``recovery`` (deferred mail waiting for a destination), ``delegation``
  (a policy service's answers), ``throttling`` (what another server of a fleet found
  dead or throttled);
- the policies: ``policy`` (the ``Policy`` base, the table of which transport runs
  which, ``module:`` loading), ``nqmgr`` (stock's, the default), ``oqmgr``, ``finch``,
  ``zmailer``; the core names none of them;
- their helpers: ``feedback`` (concurrency feedback), ``shaping`` (rates and response
  rules), ``suspension`` (operators' suspensions), ``qlist`` (stock's O(1) lists),
  ``explain`` (why mail waits, for ``pyqmgr explain``);
- ``settings``: pyqmgr.cf's scheduling parameters turned into the parsed setup
  (policies, shaping, retry) by one function, for the daemon, the simulator and
  ``pyqmgr check`` alike.
"""
